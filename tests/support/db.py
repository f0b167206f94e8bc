"""Fresh databases for tests: Postgres on 127.0.0.1:5432 (trust auth) and SQLite files.

Each test gets a database cloned from a template migrated once per session (`CREATE DATABASE ...
TEMPLATE` on Postgres, a file copy on SQLite); the fixtures in tests/conftest.py hand them out.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

PG_HOST = os.environ.get("SPECTUNE_TEST_PG_HOST", "127.0.0.1")
PG_USER = os.environ.get("SPECTUNE_TEST_PG_USER", "postgres")
PG_ADMIN_DSN = f"host={PG_HOST} port=5432 user={PG_USER} dbname=postgres"


def pg_url(dbname: str) -> str:
    return f"postgresql+psycopg://{PG_USER}@{PG_HOST}:5432/{dbname}"


def pg_admin() -> psycopg.Connection[Any]:
    return psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5)


def drop_pg(name: str) -> None:
    with pg_admin() as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def pg_clone(template: str | None, prefix: str = "spectune_t") -> Iterator[str]:
    """A fresh Postgres database cloned from `template` (an empty one when None): its URL, dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with pg_admin() as c:
        c.execute(f'CREATE DATABASE "{name}"' + ("" if template is None else f' TEMPLATE "{template}"'))
    try:
        yield pg_url(name)
    finally:
        drop_pg(name)


def sqlite_clone(template: Path, folder: Path) -> str:
    """A copy of the migrated SQLite `template` in `folder` (its URL)."""
    path = folder / "spectune.db"
    shutil.copy(template, path)
    return f"sqlite:///{path}"
