"""A retry batch's parent in its own column (it was read from the client's metadata, which anyone could set).

Existing retries keep their parent only where the metadata's `parent_batch_id` names a batch of the same owner:
a value another key's client wrote is left as plain metadata, never followed.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

PARENT = "parent_batch_id"


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column(PARENT, sa.String(64), nullable=True))
    # In SQL (no rows read here), so that the offline script (`alembic upgrade --sql`) holds it too.
    dialect = op.get_context().dialect.name
    named = ("json_extract(batches.metadata, '$.parent_batch_id')" if dialect == "sqlite"
             else "(batches.metadata ->> 'parent_batch_id')")
    op.execute(f"UPDATE batches SET {PARENT} = (SELECT p.id FROM batches AS p WHERE p.id = {named} "
               "AND p.owner = batches.owner AND p.id <> batches.id) WHERE batches.metadata IS NOT NULL")


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column(PARENT)
