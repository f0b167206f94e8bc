"""What one API process holds: settings, our engine, and Optuna's storage (one of each per process).

Created by the app factory (or a test) and passed down; nothing here is a module global.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import optuna
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from api.db import engine_kwargs, is_sqlite, lock_name, make_engine, make_sessionmaker, transaction
from api.settings import Settings


@dataclass
class ServiceContext:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    # Optuna's RDB storage wrapped once in its process-wide cache: finished trials are read from
    # the database once, later reads fetch only what changed.  `optuna.load_study` given a bare
    # RDBStorage wraps it in a fresh, empty cache on every call and re-reads the whole study.
    storage: optuna.storages.BaseStorage
    rdb: optuna.storages.RDBStorage
    sqlite: bool = field(default=False)

    @classmethod
    def open(cls, settings: Settings) -> ServiceContext:
        url = settings.database_url
        engine = make_engine(url)
        # One RDBStorage per process (reference/optuna.md §2: many leak connections).  Tables are
        # created by `spectune db upgrade`, never here, so concurrent first starts cannot race.
        rdb = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs(url), skip_table_creation=True)
        storage = optuna.storages.get_storage(rdb)
        return cls(settings, engine, make_sessionmaker(engine), storage, rdb, is_sqlite(url))

    def close(self) -> None:
        self.rdb.engine.dispose()
        self.engine.dispose()

    @contextmanager
    def unit(self, lock: str | None = None) -> Iterator[Unit]:
        """A unit of work that may call Optuna in between its database steps.

        On Postgres it is one READ COMMITTED transaction, optionally holding an advisory lock
        that serialises this unit across API processes; each step runs in a savepoint.  SQLite
        allows one writer at a time and a transaction that read before Optuna (another
        connection) wrote cannot write afterwards, so there every step is its own short
        transaction and no lock is needed: writers are serialised by SQLite itself.
        """
        if self.sqlite:
            yield Unit(self.sessions, None)
            return
        with self.sessions() as session, session.begin():
            if lock is not None:
                lock_name(session, lock)
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
