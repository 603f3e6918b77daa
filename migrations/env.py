"""Alembic environment: runs on the connection that ``trainwarden.collector.db.upgrade`` passes in,
or on ``sqlalchemy.url`` when run through the alembic command line."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from trainwarden.collector.store.models import metadata
from trainwarden.collector.store.partitions import include_name

config = context.config


def run_migrations() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(
            connection=connection,
            target_metadata=metadata,
            render_as_batch=True,
            include_name=include_name,
        )
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.begin() as conn:
        context.configure(
            connection=conn,
            target_metadata=metadata,
            render_as_batch=True,
            include_name=include_name,
        )
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=metadata)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations()
