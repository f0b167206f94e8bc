"""Bringing both schemas (spectune's and Optuna's) to head, and refusing to run on an old one."""

from __future__ import annotations

from pathlib import Path

import optuna
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect

import migrations
from api.db import engine_kwargs
from api.errors import SchemaOutdatedError

MIGRATIONS_DIR = Path(migrations.__file__).parent
VERSION_TABLE = "spectune_alembic_version"
UPGRADE_HINT = "run `spectune db upgrade` (with the same SPECTUNE_DATABASE_URL) and start again"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str) -> None:
    """Create or upgrade Optuna's tables and ours.  Run once, from one process, at deploy time."""
    # Optuna first: RDBStorage creates its tables on a new database and stamps them at head.
    storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs(url), skip_compatibility_check=True)
    if storage.get_current_version() != storage.get_head_version():
        storage.upgrade()
    storage.engine.dispose()
    command.upgrade(alembic_config(url), "head")


def head_revision(url: str) -> str:
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    assert head is not None
    return head


def check_current(engine: Engine) -> None:
    """Raise SchemaOutdatedError, naming the fix, unless both schemas are at head."""
    url = engine.url.render_as_string(hide_password=False)
    tables = set(inspect(engine).get_table_names())
    if "studies" not in tables or VERSION_TABLE not in tables:
        raise SchemaOutdatedError(f"the database has no spectune schema yet: {UPGRADE_HINT}")
    with engine.connect() as conn:
        current = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()
    if current != head_revision(url):
        raise SchemaOutdatedError(
            f"spectune's schema is at revision {current}, this version needs {head_revision(url)}: {UPGRADE_HINT}"
        )
    try:
        storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs(url), skip_table_creation=True)
    except RuntimeError as e:  # Optuna's "The runtime optuna version ... is no longer compatible"
        raise SchemaOutdatedError(f"Optuna's schema is out of date ({e}): {UPGRADE_HINT}") from e
    storage.engine.dispose()
