"""A batch's metadata as jsonb with a GIN index on PostgreSQL, so that a list's metadata filter reads the index
instead of the key's whole history (a filter that matched nothing scanned every batch the key ever made). SQLite
keeps its JSON text; the index there is a plain one, which the filter (json_each) does not read.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        op.alter_column("batches", "metadata", type_=JSONB(), postgresql_using="metadata::jsonb")
    op.create_index("ix_batches_metadata", "batches", ["metadata"], postgresql_using="gin",
                    postgresql_ops={"metadata": "jsonb_path_ops"})


def downgrade() -> None:
    op.drop_index("ix_batches_metadata", "batches")
    if op.get_context().dialect.name == "postgresql":
        op.alter_column("batches", "metadata", type_=sa.JSON(), postgresql_using="metadata::json")
