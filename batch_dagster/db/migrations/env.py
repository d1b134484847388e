"""Alembic environment: runs on a connection handed in by Database.upgrade(), or on sqlalchemy.url."""

from alembic import context
from sqlalchemy import create_engine, pool

from batch_dagster.db.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection) -> None:
    # Batch mode lets later migrations alter tables on SQLite too (copy-and-move).
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
elif config.attributes.get("connection") is not None:
    _run(config.attributes["connection"])
else:
    url = config.get_main_option("sqlalchemy.url")
    if url is None:
        raise RuntimeError("Migrations need a connection from Database.upgrade() or a sqlalchemy.url option.")
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        _run(connection)
