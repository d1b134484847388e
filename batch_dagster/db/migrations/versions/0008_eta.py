"""Queue position and ETA: a batch's estimate (stored once validated), its run's launch priority, and the place
and estimated end the daemon's queue_eta_sensor keeps up to date.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("estimate", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("launch_priority", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("queue_position", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("estimated_completion_at", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        for column in ("estimated_completion_at", "queue_position", "launch_priority", "estimate"):
            batch.drop_column(column)
