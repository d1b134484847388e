"""A batch's completed requests whose structured output was cut short by their token limit
(request_counts.incomplete_structured).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("request_incomplete_structured", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("request_incomplete_structured")
