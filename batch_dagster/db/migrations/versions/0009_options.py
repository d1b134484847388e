"""A batch's options (batchfile/options.py) kept whole in one JSON column: its priority and max_cost move there.

Only the options that differ from their defaults are kept (a batch with none has NULL), as BatchOptions.stored
writes them. In SQL (no rows read here), so that the offline script (`alembic upgrade --sql`) holds it too.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("options", sa.JSON(), nullable=True))
    if op.get_context().dialect.name == "sqlite":  # a merge patch drops the keys whose value is null
        kept = "json_patch('{}', json_object('priority', NULLIF(priority, 0), 'max_cost', max_cost))"
    else:
        kept = "json_strip_nulls(json_build_object('priority', NULLIF(priority, 0), 'max_cost', max_cost))"
    op.execute(f"UPDATE batches SET options = {kept} WHERE priority <> 0 OR max_cost IS NOT NULL")
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("priority")
        batch.drop_column("max_cost")


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("priority", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("max_cost", sa.Double(), nullable=True))
    if op.get_context().dialect.name == "sqlite":
        priority, max_cost = "json_extract(options, '$.priority')", "json_extract(options, '$.max_cost')"
    else:
        priority, max_cost = "(options ->> 'priority')::bigint", "(options ->> 'max_cost')::double precision"
    op.execute(f"UPDATE batches SET priority = COALESCE({priority}, 0), max_cost = {max_cost} "
               "WHERE options IS NOT NULL")
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("options")
