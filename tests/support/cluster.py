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
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.api_client import make_tokens
from tests.support.helpers import (
    SIM_ENV,
    free_port,
    sim_worker_toml,
    spawn,
    spawn_api,
    stop_process_group,
    write_token,
)

SERVER_PID_RE = re.compile(r"server started: pid (\d+)")


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
    root: Path,
    name: str,
    api_url: str,
    token: str,
    models: dict[str, str],
    env: dict[str, str] | None = None,
    *,
    startup_s: float = 60,
    prompt_files: dict[str, str] | None = None,
    idle_poll_max_s: float = 1,
) -> WorkerProc:
    """`root/name/worker.toml` for a worker on the simulator; `models` maps registry names to landscapes;
    `prompt_files` (name -> content) fill its prompt folder."""
    wdir = root / name
    (wdir / "models").mkdir(parents=True, exist_ok=True)
    (wdir / "prompts").mkdir(exist_ok=True)
    for file, content in (prompt_files or {}).items():
        (wdir / "prompts" / file).write_text(content)
    registry = {}
    for model, landscape in models.items():
        path = wdir / "models" / landscape
        path.mkdir(exist_ok=True)
        registry[model] = path
    write_token(wdir, token)
    cfg = wdir / "worker.toml"
    cfg.write_text(
        sim_worker_toml(
            api_url=api_url,
            worker_id=name,
            models=registry,
            top={"outbox_dir": "outbox", "prompt_dir": "prompts", "idle_poll_s": min(0.2, idle_poll_max_s),
                 "idle_poll_max_s": idle_poll_max_s},
            engine={"log_dir": "logs"},
            engine_env={**SIM_ENV, "SPECTUNE_SIM_HOST_ID": name, **(env or {})},
            timeouts={
                "startup_s": startup_s, "stop_s": 10, "gpu_release_s": 5, "request_s": 60, "api_s": 5,
                "api_retry_max_s": 1,
            },
        )
    )  # fmt: skip
    return WorkerProc(name=name, config=cfg, log=wdir / "worker.log", outbox=wdir / "outbox")


def start_worker(w: WorkerProc) -> None:
    w.proc = spawn([sys.executable, "-m", "api.cli", "worker", "--config", str(w.config)], w.log)


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

    _api_proc: subprocess.Popen[bytes] | None = None

    def start_api(self) -> None:
        self._api_proc = spawn_api(self.db_url, log_path=self.api_log, env=self.api_env, port=self.api_port)
        self.api_url = f"http://127.0.0.1:{self.api_port}"

    def stop_api(self) -> None:
        if self._api_proc is not None:
            proc, self._api_proc = self._api_proc, None
            stop_process_group(proc)

    def add_worker(
        self,
        name: str,
        models: dict[str, str],
        env: dict[str, str] | None = None,
        *,
        shared_token: bool = False,
        **kw: Any,
    ) -> WorkerProc:
        """A worker process with a token of its own, as each host of a fleet has (a confirmation
        counts only from another token than the search's, issue 35); `shared_token`: the one token
        the cluster's tests share."""
        token = self.tokens["worker"] if shared_token else self.new_token("worker", f"worker-{name}")
        w = write_worker_config(self.root, name, f"http://127.0.0.1:{self.api_port}", token, models, env, **kw)
        self.workers.append(w)
        start_worker(w)
        return w

    def new_token(self, role: str, name: str) -> str:
        from api.auth import create_token
        from api.db import make_engine, make_sessionmaker

        engine = make_engine(self.db_url)
        try:
            return create_token(make_sessionmaker(engine), role, name)[1]
        finally:
            engine.dispose()

    def create_study(self, spec: dict[str, Any]) -> None:
        r = httpx.post(f"{self.api_url}/v1/studies", json=spec, headers=self.user, timeout=30)
        assert r.status_code == 201, r.text

    def study(self, name: str) -> dict[str, Any]:
        r = httpx.get(f"{self.api_url}/v1/studies/{name}", headers=self.user, timeout=30)
        # A 5xx names only "the server log has the details": carry its tail into the failure.
        assert r.status_code == 200, (r.text, self.api_log.read_text(errors="replace")[-6000:])
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
def cluster(
    root: Path,
    db_url: str,
    *,
    lease_ttl_s: float = 6.0,
    heartbeat_interval_s: float = 1.0,
    lost_after_beats: float = 3.0,
    api_env: dict[str, str] | None = None,
) -> Iterator[Cluster]:
    """`lost_after_beats` 3 by default: 1 s beats leave a loaded test host 2 s for a late beat
    before its worker counts as lost (the service's 1.5 is for 30 s beats)."""
    c = Cluster(root=root, db_url=db_url, tokens=make_tokens(db_url), api_log=root / "api.log", api_port=free_port())
    c.api_env = {
        "SPECTUNE_HEARTBEAT_INTERVAL_S": str(heartbeat_interval_s),
        "SPECTUNE_LEASE_TTL_S": str(lease_ttl_s),
        "SPECTUNE_LOST_AFTER_BEATS": str(lost_after_beats),
        **(api_env or {}),
    }
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
