"""The intake table: files dropped in S3 or the inbox, and their batches.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "intake",
        sa.Column("pk", PK, primary_key=True, autoincrement=True),
        sa.Column("source", sa.String(1024), nullable=False),
        sa.Column("version", sa.String(255), nullable=False),
        sa.Column("batch_id", sa.String(64), sa.ForeignKey("batches.id"), nullable=False, unique=True),
        sa.Column("deliver_to", sa.String(1024), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("delivery_requested_at", sa.BigInteger(), nullable=True),
        sa.Column("delivered_at", sa.BigInteger(), nullable=True),
        sa.UniqueConstraint("source", "version", name="uq_intake_source_version"),
    )


def downgrade() -> None:
    op.drop_table("intake")
