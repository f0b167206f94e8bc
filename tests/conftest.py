"""Shared fixtures: real databases (SQLite file and Postgres on 127.0.0.1:5432), app, tokens.

Every storage-touching test takes `db_url`, which is parametrised over both backends.  Each test
gets a fresh database cloned from a template migrated once per session (`CREATE DATABASE ...
TEMPLATE` on Postgres, a file copy on SQLite), so tests never share state.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient

os.environ["TZ"] = "UTC"
time.tzset()


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM (a `timeout` around pytest, CI cancelling a job) unwinds like Ctrl-C.

    Python's default SIGTERM ends the interpreter at once: no fixture teardown, no `finally`,
    so every server a test started in its own process group outlived the run (two `spectune
    server`s from tests/test_readme.py were found an hour after a timed-out run).  As an
    exception it passes through every `finally` and teardown, which kill what they started.
    """

    def unwind(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"pytest received signal {signum}")

    signal.signal(signal.SIGTERM, unwind)


PG_HOST = os.environ.get("SPECTUNE_TEST_PG_HOST", "127.0.0.1")
PG_USER = os.environ.get("SPECTUNE_TEST_PG_USER", "postgres")
PG_ADMIN_DSN = f"host={PG_HOST} port=5432 user={PG_USER} dbname=postgres"


def pg_url(dbname: str) -> str:
    return f"postgresql+psycopg://{PG_USER}@{PG_HOST}:5432/{dbname}"


def _pg_admin() -> psycopg.Connection[Any]:
    return psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5)


def _drop_pg(name: str) -> None:
    with _pg_admin() as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def pg_clone(template: str | None, prefix: str = "spectune_t") -> Iterator[str]:
    """A fresh Postgres database cloned from `template` (an empty one when None): its URL, dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with _pg_admin() as c:
        c.execute(f'CREATE DATABASE "{name}"' + ("" if template is None else f' TEMPLATE "{template}"'))
    try:
        yield pg_url(name)
    finally:
        _drop_pg(name)


def sqlite_clone(template: Path, folder: Path) -> str:
    """A copy of the migrated SQLite `template` in `folder` (its URL)."""
    path = folder / "spectune.db"
    shutil.copy(template, path)
    return f"sqlite:///{path}"


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    from api.schema import upgrade

    name = f"spectune_tmpl_{os.getpid()}"
    try:
        _drop_pg(name)
        with _pg_admin() as c:
            c.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as e:  # pragma: no cover - CI starts Postgres first
        pytest.fail(f"Postgres is not reachable on {PG_HOST}:5432 ({e}); start it (see .ci/run)")
    upgrade(pg_url(name))
    yield name
    _drop_pg(name)


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


def make_settings(db_url: str, **overrides: Any) -> Any:
    from api.settings import Settings

    # A fixed session secret: tests that want the file-based one pass session_secret=None.
    base: dict[str, Any] = {
        "database_url": db_url,
        "heartbeat_interval_s": 1.0,
        "lease_ttl_s": 30.0,
        # In-process tests play workers that never heartbeat: their worker is lost at the lease's
        # TTL (30 beats of 1 s), as before; tests of the loss itself ask for the service's 1.5.
        "lost_after_beats": 30.0,
        # No estimate at creation (seconds of rehearsals per study); tests/test_estimate.py asks for one.
        "estimate_draws": 0,
        "session_secret": "test-session-secret-" + "x" * 32,
    }
    base.update(overrides)
    return Settings(**base)


class Api:
    """A TestClient with one token per role.

    Role "fleet" is a fleet of worker hosts, each with a token of its own (a confirmation counts
    only from another token than the one that found its candidate, issue 35): asking as worker id
    W uses W's token (made on first use), and a lease's heartbeat, progress and report go with the
    token it was handed to.  Role "worker" is one token for every worker id.
    """

    def __init__(self, client: TestClient, tokens: dict[str, str], db_url: str | None = None) -> None:
        self.client = client
        self.tokens = tokens
        self.db_url = db_url
        self.host_tokens: dict[str, str] = {}
        self.lease_tokens: dict[str, str] = {}

    def h(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    def host_token(self, worker_id: str) -> str:
        if worker_id not in self.host_tokens:
            from api.auth import create_token
            from api.db import make_engine, make_sessionmaker

            assert self.db_url is not None, "role 'fleet' needs the Api's db_url"
            engine = make_engine(self.db_url)
            try:
                self.host_tokens[worker_id] = create_token(make_sessionmaker(engine), "worker", f"host-{worker_id}")[1]
            finally:
                engine.dispose()
        return self.host_tokens[worker_id]

    def _fleet_token(self, path: str) -> str:
        parts = path.split("/")
        if path.startswith("/v1/workers/") and len(parts) > 4 and parts[4] == "lease":
            return self.host_token(parts[3])
        if path.startswith("/v1/leases/") and len(parts) > 3 and parts[3] in self.lease_tokens:
            return self.lease_tokens[parts[3]]
        return self.tokens["worker"]

    def post(self, path: str, role: str, json: Any = None, **kw: Any) -> Any:
        if role != "fleet":
            return self.client.post(path, headers=self.h(role), json=json, **kw)
        token = self._fleet_token(path)
        r = self.client.post(path, headers={"Authorization": f"Bearer {token}"}, json=json, **kw)
        if r.status_code == 200 and path.endswith("/lease") and "lease_id" in r.json():
            self.lease_tokens[r.json()["lease_id"]] = token
        return r

    def get(self, path: str, role: str, **kw: Any) -> Any:
        return self.client.get(path, headers=self.h(role), **kw)


def make_tokens(db_url: str) -> dict[str, str]:
    from api.auth import create_token
    from api.db import make_engine, make_sessionmaker

    engine = make_engine(db_url)
    try:
        factory = make_sessionmaker(engine)
        return {role: create_token(factory, role, f"test-{role}")[1] for role in ("admin", "user", "worker")}
    finally:
        engine.dispose()


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    from api.app import create_app

    tokens = make_tokens(db_url)
    with TestClient(create_app(make_settings(db_url, artifact_dir=str(tmp_path / "artifacts")))) as client:
        yield Api(client, tokens, db_url)


@pytest.fixture
def server(tmp_path: Path, sqlite_template: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A real `spectune server` on a fresh SQLite file (the embedded default): (base URL, tokens)."""
    from tests.helpers import api_server

    url = sqlite_clone(sqlite_template, tmp_path)
    tokens = make_tokens(url)
    with api_server(url, log_path=tmp_path / "api.log") as base:
        yield base, tokens


def small_spec(name: str = "s1", **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "model": {"target": "moe-pcie", "draft": "moe-pcie-eagle3"},
        "search_space": {
            "num_steps": {"low": 1, "high": 6},
            "topk": [1, 2, 4],
            "num_draft_tokens": {"low": 2, "high": 16},
        },
        "workload": {"output_len": 32, "num_prompts": 4, "concurrency": [1], "repeats": 1, "warmup_requests": 1},
        "budget": {"max_trials": 8},
        "seed": 7,
    }
    spec.update(overrides)
    return spec


def split_load_spec(name: str, *, output_len: int) -> dict[str, Any]:
    """A study on split-load (speculation pays alone and loses from 4 requests on, so the answer
    is SGLang's adaptive mode) over two chains: the search is over in two launches."""
    return small_spec(
        name,
        model={"target": "split-load", "draft": "split-load-eagle3"},
        search_space={"num_steps": {"low": 1, "high": 2}, "topk": [1]},
        workload={
            "output_len": output_len, "num_prompts": 4, "concurrency": [1, 4], "warmup_requests": 1, "repeats": 2,
        },
        budget={"max_trials": 2, "converge": False},
        confirmation={"top": 1},
        seed=11,
    )  # fmt: skip


def set_path(doc: dict[str, Any], path: str, value: Any, sep: str = ".") -> dict[str, Any]:
    """`doc` with `value` at the nested key `path` ("budget.max_trials"), tables made as needed."""
    node = doc
    *parents, last = path.split(sep)
    for k in parents:
        node = node.setdefault(k, {})
    node[last] = value
    return doc


INVENTORY: dict[str, Any] = {
    "hostname": "gpu-host",
    "sglang_version": "0.5.23",
    "models": ["moe-pcie", "moe-pcie-eagle3"],
    "gpus": [{"index": 0, "name": "NVIDIA H200", "memory_mib": 143771}],
    "labels": {"gpu": "h200"},
}


# -- nothing a test starts may outlive it ----------------------------------------------------------


def processes_marked(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose environment holds `marker` (this one excluded)."""
    needle = marker.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        # Zombies have an empty command line (their parent reaps them); multiprocessing's resource
        # tracker belongs to this pytest process and ends with it.
        if cmd and "multiprocessing.resource_tracker" not in cmd:
            found.append((int(entry.name), cmd))
    return found


@pytest.fixture(scope="module", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """Mark every process this module starts (SPECTUNE_RUN_ID is inherited, engines included:
    workers/launcher/config.py) and fail if any is still running once the module is done.

    Children stopped by their parent's death (workers/lifeline.py) get a bounded moment to go;
    whatever is left is killed, so one leak cannot spill into the next module, and reported.
    """
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
