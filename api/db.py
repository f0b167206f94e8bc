"""Database engines and sessions for spectune's own tables, and the database clock.

Cross-process coordination lives in the database (docs/design.md "Storage"): timestamps come from
the database server, never from the API process, so several API processes agree on deadlines.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, make_url, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from api.errors import BusyError

SQLITE_BUSY_TIMEOUT_S = 30.0


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


@dataclass(frozen=True)
class Waits:
    """How long one Postgres statement may run, and wait for a lock, before it fails.

    Set on every session (ours and Optuna's), so no request waits without limit: a table lock
    held by hand kept `GET /v1/workers` waiting 28 s.  A statement past either fails, and the
    error mapping answers 503 with Retry-After (api/errors.py).  `lock_name` raises the lock wait
    of its own transaction where a report must wait longer.
    """

    # Ten seconds, as LOCK_WAIT_MS: no row or table is held longer by a healthy request.
    lock_timeout_ms: int = 10_000
    # A minute: the slowest statement of a healthy service (a report over a large study) takes
    # well under a second (benchmarks/README.md); above REPORT_LOCK_WAIT_MS, which is one statement.
    statement_timeout_ms: int = 60_000


def engine_kwargs(url: str, waits: Waits | None = None) -> dict[str, Any]:
    """Engine options shared by our engine and Optuna's RDBStorage for the same URL."""
    if is_sqlite(url):
        return {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False}}
    w = waits or Waits()
    options = f"-c lock_timeout={int(w.lock_timeout_ms)} -c statement_timeout={int(w.statement_timeout_ms)}"
    # Postgres: pre-ping so a database restart costs one retried connection, not an error.
    return {"pool_pre_ping": True, "pool_size": 10, "max_overflow": 20, "connect_args": {"options": options}}


def make_engine(url: str, *, immediate: bool = True, waits: Waits | None = None) -> Engine:
    """An engine for `url`; on SQLite, `immediate` picks the transaction kind (see below)."""
    engine = create_engine(url, **engine_kwargs(url, waits))
    if is_sqlite(url):
        install_sqlite_transactions(engine, immediate=immediate)
    return engine


def install_sqlite_transactions(engine: Engine, *, immediate: bool = True) -> None:
    """Make every transaction on this SQLite engine take the write lock up front.

    With `immediate=False` (read-only sessions) a transaction is a plain deferred one: in WAL
    mode it reads a consistent snapshot and never blocks a writer.  The rule that keeps this free
    of self-deadlocks: never call Optuna (its own engine, also immediate) while one of our write
    transactions is open (ServiceContext.unit); reads may.

    Applied to our engine and to Optuna's (ServiceContext.open).  SQLite has no row locks: a
    deferred transaction reads, then fails with "database is locked" (without waiting: the busy
    timeout does not apply to a read lock that must be upgraded) or, worse, two of them read the
    same row before either writes.  That is how two concurrent asks once popped the same enqueued
    Optuna trial and a worker relaunched its server in a loop (tests/api/test_lease_livelock.py).
    `BEGIN IMMEDIATE` waits for the busy timeout instead and serialises read-then-write steps.
    """

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
        # Take over transaction control from the driver (it would BEGIN only before writes).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        # WAL lets readers and one writer work side by side; the setting persists in the file.
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cur.close()

    begin = "BEGIN IMMEDIATE" if immediate else "BEGIN"

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql(begin)

    # Connections opened before the hooks were installed would bypass them.
    engine.dispose()


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
# A report waits longer for its study: turned away, it is sent again (the worker's outbox), but
# the launch it measured must never be lost to a busy lock.  Asks never queue on a study (they
# try the next one), so what holds the lock is one ask, report or expiry at a time.
REPORT_LOCK_WAIT_MS = 30_000
LOCK_NOT_AVAILABLE = "55P03"  # Postgres: lock_timeout expired


def advisory_lock_key(name: str) -> int:
    """A stable signed 64-bit key for pg_advisory_xact_lock."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


def sqlite_path(url: str) -> Path | None:
    """The database file of a SQLite URL (None for an in-memory database)."""
    database = make_url(url).database
    if not database or database == ":memory:":
        return None
    return Path(database)


@contextmanager
def file_lock(folder: Path, name: str, wait_ms: int = LOCK_WAIT_MS) -> Iterator[None]:
    """Serialise work on `name` across threads and processes that share one SQLite file.

    The SQLite counterpart of `lock_name`: an exclusive flock on a file per name beside the
    database.  flock locks belong to the open file description, so two threads of one process
    exclude each other too.  The wait is bounded like Postgres's lock_timeout: BusyError after it.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{advisory_lock_key(name) & 0xFFFFFFFFFFFF:012x}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BusyError(f"{name} is busy; ask again shortly") from None
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)  # releases the lock


def lock_name(session: Session, name: str, wait_ms: int = LOCK_WAIT_MS) -> None:
    """Serialise work on `name` across API processes until this transaction ends.

    Postgres: a transaction-scoped advisory lock, waited for at most `wait_ms` (0: taken only if
    free at once); BusyError otherwise.  SQLite: see `file_lock` (ServiceContext.unit takes it,
    since SQLite units are not one transaction).
    """
    if session.get_bind().dialect.name == "sqlite":
        return
    key = {"k": advisory_lock_key(name)}
    if wait_ms <= 0:
        if not session.execute(text("SELECT pg_try_advisory_xact_lock(:k)"), key).scalar_one():
            raise BusyError(f"{name} is busy; ask again shortly")
        return
    # Bounded wait: a request queued behind many others holds a pooled connection all the
    # while, and 64 workers asking at once would drain the pool (heartbeats then starve).
    session.execute(text(f"SET LOCAL lock_timeout = '{int(wait_ms)}ms'"))
    try:
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), key)
    except OperationalError as e:
        if getattr(e.orig, "sqlstate", None) == LOCK_NOT_AVAILABLE:
            raise BusyError(f"{name} is busy; ask again shortly") from e
        raise
