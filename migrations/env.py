"""Alembic environment.  Run through `spectune db upgrade`, which passes the database URL."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from api.models import Base

VERSION_TABLE = "spectune_alembic_version"  # Optuna's own Alembic owns `alembic_version`.

config = context.config
url = config.get_main_option("sqlalchemy.url")


def _include(name: str | None, type_: str, *_: object) -> bool:
    # Only our tables: Optuna's live in the same database and have their own migrations.
    return not (type_ == "table" and name is not None and not name.startswith("spectune_"))


def run_migrations_offline() -> None:
    context.configure(
        url=url,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
        include_name=_include,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        _run(connectable)
        return
    assert url is not None
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        _run(connection)
    engine.dispose()


def _run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        include_name=_include,
        compare_type=True,
        render_as_batch=True,  # SQLite needs batch mode for ALTERs
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
