"""End-to-end plumbing: a real API process, real worker processes, the simulated engine.

Everything talks real HTTP on 127.0.0.1; processes are started in their own groups and every
one of them (the engines the workers start included) is stopped at teardown.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from tests.conftest import make_tokens
from tests.servers import api_server, free_port, stop_process_group
from workers.lifeline import child_env

T = TypeVar("T")
SERVER_PID_RE = re.compile(r"server started: pid (\d+)")

# Fast but faithful: every rate x40, start-up at 0.2% of the modelled minutes.
SIM_ENV = {"SPECTUNE_SIM_SPEED": "40", "SPECTUNE_SIM_TIME_SCALE": "0.002"}


def wait_for(what: str, fn: Callable[[], T | None], timeout: float, interval: float = 0.2) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class WorkerProc:
    name: str
    config: Path
    log: Path
    outbox: Path
    proc: subprocess.Popen[bytes] | None = None
    server_pids: set[int] = field(default_factory=set)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def engine_pids(self) -> set[int]:
        return {int(m) for m in SERVER_PID_RE.findall(self.log_text())}


def write_worker_config(
    root: Path, name: str, api_url: str, token: str, models: dict[str, str], env: dict[str, str] | None = None,
    *, startup_s: float = 60,
) -> WorkerProc:  # fmt: skip
    wdir = root / name
    (wdir / "models").mkdir(parents=True, exist_ok=True)
    registry = []
    for model, landscape in models.items():
        path = wdir / "models" / landscape
        path.mkdir(exist_ok=True)
        registry.append(f'"{model}" = "{path}"')
    (wdir / "token").write_text(token + "\n")
    (wdir / "token").chmod(0o600)
    engine_env = "\n".join(f'{k} = "{v}"' for k, v in {**SIM_ENV, "SPECTUNE_SIM_HOST_ID": name, **(env or {})}.items())
    cfg = wdir / "worker.toml"
    cfg.write_text(
        f"""api_url = "{api_url}"
token_file = "token"
worker_id = "{name}"
outbox_dir = "outbox"
idle_poll_s = 0.2
idle_poll_max_s = 1

[engine]
python = "{sys.executable}"
module = "spectune_sim"
port = {free_port()}
sglang_version = "0.5.23"
log_dir = "logs"

[engine.env]
{engine_env}

[timeouts]
startup_s = {startup_s}
stop_s = 10
gpu_release_s = 5
request_s = 60
api_s = 5
api_retry_max_s = 1

[models]
{chr(10).join(registry)}
"""
    )
    return WorkerProc(name=name, config=cfg, log=wdir / "worker.log", outbox=wdir / "outbox")


def start_worker(w: WorkerProc) -> None:
    with open(w.log, "ab") as log:
        w.proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "worker", "--config", str(w.config)],
            stdout=log, stderr=subprocess.STDOUT, env=child_env({**os.environ, "TZ": "UTC"}), start_new_session=True,
        )  # fmt: skip


def kill_engines(w: WorkerProc) -> None:
    """Make sure no engine a worker started outlives the test (a SIGKILLed worker leaves its own)."""
    for pid in w.engine_pids():
        try:
            os.killpg(pid, signal.SIGKILL)  # the launcher starts each engine as a group leader
        except (ProcessLookupError, PermissionError):
            pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is not alive: its memory and ports are gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def group_alive(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@dataclass
class Cluster:
    root: Path
    db_url: str
    tokens: dict[str, str]
    api_url: str = ""
    api_log: Path = Path()
    workers: list[WorkerProc] = field(default_factory=list)
    stack: ExitStack = field(default_factory=ExitStack)
    api_port: int = 0
    api_env: dict[str, str] = field(default_factory=dict)

    @property
    def user(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens['user']}"}

    _api_cm: Any = None

    def start_api(self) -> None:
        cm = api_server(self.db_url, log_path=self.api_log, env=self.api_env, port=self.api_port)
        self.api_url = cm.__enter__()
        self._api_cm = cm

    def stop_api(self) -> None:
        if self._api_cm is not None:
            cm, self._api_cm = self._api_cm, None
            cm.__exit__(None, None, None)

    def add_worker(self, name: str, models: dict[str, str], env: dict[str, str] | None = None, **kw: Any) -> WorkerProc:
        w = write_worker_config(
            self.root, name, f"http://127.0.0.1:{self.api_port}", self.tokens["worker"], models, env, **kw
        )
        self.workers.append(w)
        start_worker(w)
        return w

    def create_study(self, spec: dict[str, Any]) -> None:
        r = httpx.post(f"{self.api_url}/v1/studies", json=spec, headers=self.user, timeout=30)
        assert r.status_code == 201, r.text

    def study(self, name: str) -> dict[str, Any]:
        r = httpx.get(f"{self.api_url}/v1/studies/{name}", headers=self.user, timeout=30)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def trials(self, name: str) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.api_url}/v1/studies/{name}/trials", headers=self.user, timeout=30).json())

    def fleet(self) -> dict[str, dict[str, Any]]:
        workers = httpx.get(f"{self.api_url}/v1/workers", headers=self.user, timeout=30).json()
        return {w["id"]: w for w in workers}

    def leases(self, study: str) -> list[dict[str, Any]]:
        """Every lease of a study from the database, oldest first."""
        from sqlalchemy import select

        from api.db import make_engine, make_sessionmaker
        from api.models import LeaseRow

        engine = make_engine(self.db_url)
        try:
            with make_sessionmaker(engine)() as s:
                rows = s.scalars(
                    select(LeaseRow).where(LeaseRow.study_name == study).order_by(LeaseRow.created_at, LeaseRow.id)
                ).all()
                return [
                    {
                        "id": r.id, "kind": r.kind, "state": r.state, "worker_id": r.worker_id,
                        "trial_number": r.trial_number, "attempt": r.attempt, "created_at": r.created_at,
                        "leased_at": r.leased_at, "result": r.result,
                    }
                    for r in rows
                ]  # fmt: skip
        finally:
            engine.dispose()


@contextmanager
def cluster(root: Path, db_url: str, *, lease_ttl_s: float = 6.0) -> Iterator[Cluster]:
    c = Cluster(root=root, db_url=db_url, tokens=make_tokens(db_url), api_log=root / "api.log", api_port=free_port())
    c.api_env = {"SPECTUNE_HEARTBEAT_INTERVAL_S": "1", "SPECTUNE_LEASE_TTL_S": str(lease_ttl_s)}
    c.start_api()
    try:
        yield c
    finally:
        for w in c.workers:
            if w.proc is not None:
                stop_process_group(w.proc, timeout=30)
        for w in c.workers:
            kill_engines(w)
        c.stop_api()
