"""What a batch's folder keeps beside its files (`stored_bytes`), which the key's stored-bytes limit counts.

Batches from before it count their own copy of their input (its File's size, unless the File is that copy, as a
command-line batch's is): their working files are measured only if retention clears their folder. In SQL, so that the
offline script (`alembic upgrade --sql`) holds it too.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("stored_bytes", sa.BigInteger(), nullable=False, server_default="0"))
    op.execute("UPDATE batches SET stored_bytes = (SELECT files.bytes FROM files WHERE files.id = batches.input_file_id"
               " AND files.path <> 'batches/' || batches.id || '/input.jsonl') WHERE EXISTS (SELECT 1 FROM files"
               " WHERE files.id = batches.input_file_id AND files.path <> 'batches/' || batches.id || '/input.jsonl')")


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("stored_bytes")
