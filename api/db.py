"""Database engines and sessions for spectune's own tables, and the database clock.

Cross-process coordination lives in the database (design.md "Storage"): timestamps come from
the database server, never from the API process, so several API processes agree on deadlines.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from api.errors import BusyError

SQLITE_BUSY_TIMEOUT_S = 30.0


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def engine_kwargs(url: str) -> dict[str, Any]:
    """Engine options shared by our engine and Optuna's RDBStorage for the same URL."""
    if is_sqlite(url):
        return {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False}}
    # Postgres: pre-ping so a database restart costs one retried connection, not an error.
    return {"pool_pre_ping": True, "pool_size": 10, "max_overflow": 20}


def make_engine(url: str) -> Engine:
    engine = create_engine(url, **engine_kwargs(url))
    if is_sqlite(url):

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # Take over transaction control from the driver (it would BEGIN only before writes).
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            # WAL lets readers and one writer work side by side; the setting persists in the file.
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin_immediate(conn: Any) -> None:
            # Every transaction takes SQLite's write lock up front, so a read-then-write step is
            # isolated from a concurrent one (SQLite has no row locks).  Optuna's own engine is
            # never called while one of ours is open: see ServiceContext.unit.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One short transaction: commit on success, roll back on any error."""
    with factory() as session, session.begin():
        yield session


def db_now(session: Session) -> datetime:
    """The database server's current time, as naive UTC."""
    if session.get_bind().dialect.name == "sqlite":
        raw = session.execute(text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")).scalar_one()
        return datetime.fromisoformat(str(raw))
    # clock_timestamp(), not now(): now() is the transaction's start, and a lease that waited for
    # a lock would get a deadline from before the wait.
    value = session.execute(text("SELECT timezone('UTC', clock_timestamp())")).scalar_one()
    assert isinstance(value, datetime)
    return value.replace(tzinfo=None)


LOCK_WAIT_MS = 10_000
LOCK_NOT_AVAILABLE = "55P03"  # Postgres: lock_timeout expired


def advisory_lock_key(name: str) -> int:
    """A stable signed 64-bit key for pg_advisory_xact_lock."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


def lock_name(session: Session, name: str) -> None:
    """Serialise work on `name` across API processes until this transaction ends.

    Postgres: a transaction-scoped advisory lock.  SQLite serialises writers by itself, and the
    unique constraints on our tables catch the rest, so nothing is taken there.
    """
    if session.get_bind().dialect.name != "sqlite":
        # Bounded wait: a request queued behind many others holds a pooled connection all the
        # while, and 64 workers asking at once would drain the pool (heartbeats then starve).
        session.execute(text(f"SET LOCAL lock_timeout = '{LOCK_WAIT_MS}ms'"))
        try:
            session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": advisory_lock_key(name)})
        except OperationalError as e:
            if getattr(e.orig, "sqlstate", None) == LOCK_NOT_AVAILABLE:
                raise BusyError(f"{name} is busy; ask again shortly") from e
            raise
