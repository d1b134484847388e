"""Deadlines: when the queue first estimated that a batch will end after its deadline (its batch.deadline_at_risk
event is written then, once).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("deadline_at_risk_at", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("deadline_at_risk_at")
