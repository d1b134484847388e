"""The first schema: api_keys, files, batches.

Revision ID: 0001
Revises:
Create Date: 2026-11-20
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("owner", sa.String(64), primary_key=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "files",
        sa.Column("pk", PK, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("owner", sa.String(64), sa.ForeignKey("api_keys.owner"), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=True),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("batch_id", sa.String(64), nullable=True),
    )
    op.create_index("ix_files_owner_pk", "files", ["owner", "pk"])
    op.create_table(
        "batches",
        sa.Column("pk", PK, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(64), nullable=False, unique=True),
        sa.Column("owner", sa.String(64), sa.ForeignKey("api_keys.owner"), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        *(sa.Column(name, sa.BigInteger(), nullable=True) for name in (
            "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
            "cancelling_at", "cancelled_at")),
        sa.Column("request_total", sa.BigInteger(), nullable=False),
        sa.Column("request_completed", sa.BigInteger(), nullable=False),
        sa.Column("request_failed", sa.BigInteger(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("model", sa.String(255), nullable=True),
        sa.Column("usage", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("output_expires_after", sa.BigInteger(), nullable=True),
        sa.Column("launched_at", sa.BigInteger(), nullable=True),
        sa.Column("run_id", sa.String(64), nullable=True),
    )
    op.create_index("ix_batches_owner_pk", "batches", ["owner", "pk"])
    op.create_index("ix_batches_status", "batches", ["status"])


def downgrade() -> None:
    op.drop_table("batches")
    op.drop_table("files")
    op.drop_table("api_keys")
