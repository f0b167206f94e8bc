"""What one API process holds: settings, our engine, and Optuna's storage (one of each per process).

Created by the app factory (or a test) and passed down; nothing here is a module global.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from api.db import (
    LOCK_WAIT_MS,
    Waits,
    engine_kwargs,
    file_lock,
    install_sqlite_transactions,
    is_sqlite,
    lock_name,
    make_engine,
    make_sessionmaker,
    sqlite_path,
    transaction,
)
from api.settings import Settings


@dataclass
class ServiceContext:
    settings: Settings
    engine: Engine
    # Read-only sessions.  On SQLite they are deferred transactions on an engine of their own, so
    # a reader that calls Optuna meanwhile never waits for itself; writes go through `unit`.
    sessions: sessionmaker[Session]
    # Optuna's RDB storage wrapped once in its process-wide cache: finished trials are read from
    # the database once, later reads fetch only what changed.  `optuna.load_study` given a bare
    # RDBStorage wraps it in a fresh, empty cache on every call and re-reads the whole study.
    storage: optuna.storages.BaseStorage
    rdb: optuna.storages.RDBStorage
    sqlite: bool = field(default=False)
    # SQLite only: where the per-name lock files live (db.file_lock).
    lock_dir: Path | None = None
    # Write sessions (units); the same as `sessions` on Postgres.
    writes: sessionmaker[Session] | None = None
    read_engine: Engine | None = None

    @classmethod
    def open(cls, settings: Settings) -> ServiceContext:
        url = settings.database_url
        waits = Waits(settings.db_lock_timeout_ms, settings.db_statement_timeout_ms)
        engine = make_engine(url, waits=waits)
        # One RDBStorage per process (docs/optuna.md §2: many leak connections).  Tables are
        # created by `spectune db upgrade`, never here, so concurrent first starts cannot race.
        rdb = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs(url, waits), skip_table_creation=True)
        sqlite = is_sqlite(url)
        lock_dir = None
        if sqlite:
            # Optuna's engine gets the same transactions as ours: popping an enqueued trial reads
            # then writes, and two deferred transactions would both pop it.
            install_sqlite_transactions(rdb.engine)
            path = sqlite_path(url)
            lock_dir = Path(tempfile.gettempdir()) / "spectune-locks" if path is None else Path(f"{path}.locks")
        storage = optuna.storages.get_storage(rdb)
        read_engine = make_engine(url, immediate=False, waits=waits) if sqlite else engine
        return cls(
            settings,
            engine,
            make_sessionmaker(read_engine),
            storage,
            rdb,
            sqlite,
            lock_dir,
            writes=make_sessionmaker(engine),
            read_engine=read_engine,
        )

    @property
    def write_sessions(self) -> sessionmaker[Session]:
        return self.writes or self.sessions

    def close(self) -> None:
        self.rdb.engine.dispose()
        self.engine.dispose()
        if self.read_engine is not None and self.read_engine is not self.engine:
            self.read_engine.dispose()

    @contextmanager
    def unit(self, lock: str | None = None, wait_ms: int = LOCK_WAIT_MS) -> Iterator[Unit]:
        """A unit of work that may call Optuna in between its database steps.

        On Postgres it is one READ COMMITTED transaction, optionally holding an advisory lock
        that serialises this unit across API processes; each step runs in a savepoint.  SQLite
        allows one writer at a time and a transaction that read before Optuna (another
        connection) wrote cannot write afterwards, so there every step is its own short
        transaction, and the lock is a file lock held for the whole unit.  `wait_ms` bounds the
        wait for the lock (0: only if it is free now); BusyError after it.
        """
        if self.sqlite:
            if lock is None or self.lock_dir is None:
                yield Unit(self.write_sessions, None)
                return
            with file_lock(self.lock_dir, lock, wait_ms):
                yield Unit(self.write_sessions, None)
            return
        with self.write_sessions() as session, session.begin():
            if lock is not None:
                lock_name(session, lock, wait_ms)
            yield Unit(self.sessions, session)


class Unit:
    def __init__(self, factory: sessionmaker[Session], session: Session | None) -> None:
        self._factory = factory
        self._session = session

    @contextmanager
    def step(self) -> Iterator[Session]:
        if self._session is None:
            with transaction(self._factory) as s:
                yield s
            return
        with self._session.begin_nested():
            yield self._session
