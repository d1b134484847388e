"""Per-owner webhook endpoints, and which endpoint (none: a global one) each delivery is for.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "webhook_endpoints",
        sa.Column("pk", PK, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("owner", sa.String(64), sa.ForeignKey("api_keys.owner"), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("url", sa.String(1024), nullable=False),
        sa.Column("event_types", sa.JSON(), nullable=False),
        sa.Column("secret", sa.Text(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("deleted_at", sa.BigInteger(), nullable=True),
    )
    op.create_index("ix_webhook_endpoints_owner_pk", "webhook_endpoints", ["owner", "pk"])
    # Batch mode: SQLite alters a table's constraints only by copying it (Postgres gets plain ALTERs).
    with op.batch_alter_table("webhook_deliveries") as batch:
        batch.add_column(sa.Column("endpoint_id", sa.String(64), nullable=True))
        batch.create_foreign_key("fk_webhook_deliveries_endpoint_id", "webhook_endpoints", ["endpoint_id"], ["id"])
        # The same URL may now be a global endpoint and an owner's, each signed with its own secret.
        batch.drop_constraint("uq_webhook_delivery_event_url", type_="unique")
        batch.create_unique_constraint("uq_webhook_delivery_event_endpoint_url", ["event_id", "endpoint_id", "url"])


def downgrade() -> None:
    op.execute("DELETE FROM webhook_deliveries WHERE endpoint_id IS NOT NULL")
    with op.batch_alter_table("webhook_deliveries") as batch:
        batch.drop_constraint("uq_webhook_delivery_event_endpoint_url", type_="unique")
        batch.create_unique_constraint("uq_webhook_delivery_event_url", ["event_id", "url"])
        batch.drop_constraint("fk_webhook_deliveries_endpoint_id", type_="foreignkey")
        batch.drop_column("endpoint_id")
    op.drop_index("ix_webhook_endpoints_owner_pk", table_name="webhook_endpoints")
    op.drop_table("webhook_endpoints")
