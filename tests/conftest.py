"""Shared fixtures: real databases (SQLite file and Postgres on 127.0.0.1:5432), app, tokens.

Fixtures only: the helpers they use, and every other helper tests share, live in tests/support/.

Every storage-touching test takes `db_url`, which is parametrised over both backends.  Each test
gets a fresh database cloned from a template migrated once per session (`CREATE DATABASE ...
TEMPLATE` on Postgres, a file copy on SQLite), so tests never share state.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from fastapi.testclient import TestClient

from tests.support.api_client import Api, make_settings, make_tokens
from tests.support.db import PG_HOST, drop_pg, pg_admin, pg_clone, pg_url, sqlite_clone

os.environ["TZ"] = "UTC"
time.tzset()


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM (a `timeout` around pytest, CI cancelling a job) unwinds like Ctrl-C.

    Python's default SIGTERM ends the interpreter at once: no fixture teardown, no `finally`,
    so every server a test started in its own process group outlived the run (two `spectune
    server`s from tests/deploy/test_readme.py were found an hour after a timed-out run).  As an
    exception it passes through every `finally` and teardown, which kill what they started.
    """

    def unwind(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"pytest received signal {signum}")

    signal.signal(signal.SIGTERM, unwind)


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    from api.schema import upgrade

    name = f"spectune_tmpl_{os.getpid()}"
    try:
        drop_pg(name)
        with pg_admin() as c:
            c.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as e:  # pragma: no cover - CI starts Postgres first
        pytest.fail(f"Postgres is not reachable on {PG_HOST}:5432 ({e}); start it (see .ci/run)")
    upgrade(pg_url(name))
    yield name
    drop_pg(name)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from api.schema import upgrade

    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield sqlite_clone(request.getfixturevalue("sqlite_template"), tmp_path)
        return
    with pg_clone(request.getfixturevalue("pg_template")) as url:
        yield url


@pytest.fixture
def pg_db_url(pg_template: str) -> Iterator[str]:
    """A fresh Postgres database only (for tests that are about Postgres behaviour)."""
    with pg_clone(pg_template) as url:
        yield url


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    from api.app import create_app

    tokens = make_tokens(db_url)
    with TestClient(create_app(make_settings(db_url, artifact_dir=str(tmp_path / "artifacts")))) as client:
        yield Api(client, tokens, db_url)


@pytest.fixture
def server(tmp_path: Path, sqlite_template: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A real `spectune server` on a fresh SQLite file (the embedded default): (base URL, tokens)."""
    from tests.support.helpers import api_server

    url = sqlite_clone(sqlite_template, tmp_path)
    tokens = make_tokens(url)
    with api_server(url, log_path=tmp_path / "api.log") as base:
        yield base, tokens


# -- nothing a test starts may outlive it ----------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """Mark every process this module starts (SPECTUNE_RUN_ID is inherited, engines included:
    workers/launcher/config.py) and fail if any is still running once the module is done.

    Children stopped by their parent's death (workers/lifeline.py) get a bounded moment to go;
    whatever is left is killed, so one leak cannot spill into the next module, and reported.
    """
    from tests.support.helpers import processes_marked
    from workers.lifeline import RUN_ID_ENV

    marker = f"{RUN_ID_ENV}=test-{uuid.uuid4().hex}"
    previous = os.environ.get(RUN_ID_ENV)
    os.environ[RUN_ID_ENV] = marker.split("=", 1)[1]
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RUN_ID_ENV, None)
        else:
            os.environ[RUN_ID_ENV] = previous
        left = processes_marked(marker)
        for _ in range(200):  # up to ~20 s: SIGTERM handling, engines draining
            if not left:
                break
            time.sleep(0.1)
            left = processes_marked(marker)
        for pid, _ in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert not left, "processes started by this module outlived it:\n" + "\n".join(
            f"  {pid}: {cmd[:200]}" for pid, cmd in left
        )
