"""Operating the service: API keys managed in the store (their names, roles, limits, rotation and revocation), the
first estimated end of a batch (the ETA's error in the metrics), the sensors' tick records and the warm fleets.

Existing owners get no key here: the API seeds BATCH_API_KEYS' keys when it starts (db/keys.py), and an owner whose
key left the variable stays without one.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


KEY_COLUMNS: tuple[sa.Column, ...] = (
    sa.Column("name", sa.String(64), nullable=True),
    sa.Column("key_hash", sa.String(64), nullable=True),
    sa.Column("admin", sa.Boolean(), nullable=False, server_default=sa.false()),
    sa.Column("created_by", sa.String(32), nullable=True),
    sa.Column("revoked_at", sa.BigInteger(), nullable=True),
    sa.Column("rotated_at", sa.BigInteger(), nullable=True),
    sa.Column("max_active_batches", sa.BigInteger(), nullable=True),
    sa.Column("max_stored_bytes", sa.BigInteger(), nullable=True),
    sa.Column("daily_budget", sa.Float(), nullable=True),
    sa.Column("max_priority", sa.Integer(), nullable=True),
)


def upgrade() -> None:
    # Plain ADD COLUMN and unique indexes: SQLite would otherwise copy api_keys, which the other tables reference.
    for column in KEY_COLUMNS:
        op.add_column("api_keys", column)
    op.create_index("ix_api_keys_name", "api_keys", ["name"], unique=True)
    op.create_index("ix_api_keys_key_hash", "api_keys", ["key_hash"], unique=True)
    op.add_column("batches", sa.Column("first_estimated_completion_at", sa.BigInteger(), nullable=True))
    op.create_table(
        "sensor_ticks",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("ticks", sa.BigInteger(), nullable=False),
        sa.Column("failures", sa.BigInteger(), nullable=False),
        sa.Column("seconds_total", sa.Float(), nullable=False),
        sa.Column("last_seconds", sa.Float(), nullable=False),
        sa.Column("last_at", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "fleets",
        sa.Column("model", sa.String(255), primary_key=True),
        sa.Column("url", sa.String(255), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("start_s", sa.Float(), nullable=True),
        sa.Column("changed_at", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("fleets")
    op.drop_table("sensor_ticks")
    with op.batch_alter_table("batches") as batches:
        batches.drop_column("first_estimated_completion_at")
    op.drop_index("ix_api_keys_key_hash", "api_keys")
    op.drop_index("ix_api_keys_name", "api_keys")
    with op.batch_alter_table("api_keys") as keys:
        for column in reversed(KEY_COLUMNS):
            keys.drop_column(column.name)
