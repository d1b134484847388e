"""The webhook outbox: events of batches that ended, and their deliveries to each endpoint.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "webhook_events",
        sa.Column("pk", PK, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("type", sa.String(32), nullable=False),
        sa.Column("batch_id", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("planned_at", sa.BigInteger(), nullable=True),
    )
    op.create_index("ix_webhook_events_planned_at", "webhook_events", ["planned_at"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("pk", PK, primary_key=True, autoincrement=True),
        sa.Column("event_id", sa.String(64), sa.ForeignKey("webhook_events.id"), nullable=False),
        sa.Column("url", sa.String(1024), nullable=False),
        sa.Column("attempts", sa.BigInteger(), nullable=False),
        sa.Column("next_attempt_at", sa.BigInteger(), nullable=False),
        sa.Column("delivered_at", sa.BigInteger(), nullable=True),
        sa.Column("failed_at", sa.BigInteger(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.UniqueConstraint("event_id", "url", name="uq_webhook_delivery_event_url"),
    )
    op.create_index("ix_webhook_deliveries_due", "webhook_deliveries", ["delivered_at", "failed_at", "next_attempt_at"])


def downgrade() -> None:
    op.drop_table("webhook_deliveries")
    op.drop_table("webhook_events")
