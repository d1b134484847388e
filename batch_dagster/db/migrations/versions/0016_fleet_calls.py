"""Fleets: when the API last forwarded an interactive call to a model's fleet, so that serve keeps a fleet in use
warm and wakes one that sleeps when a call wants it.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("fleets") as batch:
        batch.add_column(sa.Column("called_at", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("fleets") as batch:
        batch.drop_column("called_at")
