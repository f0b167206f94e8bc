"""What many tests need once each: a free port, waiting (for a condition, for a process to serve
HTTP), stopping a process group, a real `spectune server` process, the TOML of a worker that
drives the simulated engine, a study's Postgres lock held as another request holds it, a lease's
successful report, calls from many threads released at the same instant, and the processes a
marker in their environment names (tests/conftest.py's check that none outlives its module).

Everything is on 127.0.0.1; every process started here runs in its own group and is stopped
(SIGTERM, then SIGKILL) on every path out.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psycopg

from api.db import advisory_lock_key
from workers.lifeline import child_env

T = TypeVar("T")
# The checkout this file is in (tests/support/helpers.py).
REPO = Path(__file__).resolve().parents[2]

# The simulated engine, fast but faithful: every rate x40, start-up at 0.2% of the modelled minutes.
SIM_ENV = {"SPECTUNE_SIM_SPEED": "40", "SPECTUNE_SIM_TIME_SCALE": "0.002"}


def copy_checkout(dest: Path) -> Path:
    """A user's checkout of this tree (no venv, no git, no build outputs), for install tests
    that run `make dist` as the README prints it without writing into this tree."""
    skip = shutil.ignore_patterns(".git", ".venv", "dist", "build", "*.egg-info", "__pycache__", ".*_cache", "*.db")
    shutil.copytree(REPO, dest, ignore=skip)
    return dest


def build_dist(checkout: Path) -> Path:
    """`make dist` in `checkout` (this interpreter's python3 first on PATH); the wheel it built."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(["make", "dist"], cwd=checkout, env=env, check=True, capture_output=True, timeout=600)
    (wheel,) = (checkout / "dist").glob("spectune-*.whl")
    return wheel


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    what: str,
    fn: Callable[[], T | None],
    timeout: float = 20.0,
    interval: float = 0.05,
    context: Callable[[], str] | None = None,
) -> T:
    """Poll `fn` until it returns something truthy and return that; fail naming `what` (and
    `context()`, e.g. a log, when given) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"\n{context()}" if context is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")
        time.sleep(interval)


def wait_serving(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 60.0) -> None:
    """Wait until GET `url` answers 200; fail at once, with the log's tail, if `proc` exits first."""

    def serving() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"process {proc.pid} exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            return httpx.get(url, timeout=2.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(f"{url} to answer", serving, timeout, interval=0.1, context=lambda: _tail(log_path))


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:] if path.exists() else "(no log)"


def spawn(argv: list[str], log_path: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`argv` in its own process group (stop it with `stop_process_group`), output appended to `log_path`.

    The child gets TZ=UTC and follows this process if it is killed outright (workers/lifeline.py).
    """
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env({**os.environ, "TZ": "UTC", **(env or {})}),
            start_new_session=True,
        )


def stop_process_group(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM the group `proc` leads, then SIGKILL it if it has not exited within `timeout`."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)


def spawn_api(
    db_url: str,
    *,
    log_path: Path,
    port: int,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    workers: int = 1,
) -> subprocess.Popen[bytes]:
    """Start `spectune server` (`--workers` processes) on 127.0.0.1:`port` and wait until /healthz
    answers (the caller stops it)."""
    artifacts = str(log_path.parent / "artifacts")
    argv = [sys.executable, "-m", "api.cli", "server", "--database-url", db_url]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)]
    # No estimate at creation unless asked (seconds of rehearsals per study created).
    proc = spawn(argv, log_path, {"SPECTUNE_ARTIFACT_DIR": artifacts, "SPECTUNE_ESTIMATE_DRAWS": "0", **(env or {})})
    try:
        wait_serving(f"http://127.0.0.1:{port}/healthz", proc, log_path, timeout)
    except BaseException:
        stop_process_group(proc)
        raise
    return proc


@contextmanager
def api_server(
    db_url: str, *, log_path: Path, env: Mapping[str, str] | None = None, port: int | None = None
) -> Iterator[str]:
    """A `spectune server` process serving `db_url`: yields its base URL, stops it afterwards."""
    port = port or free_port()
    proc = spawn_api(db_url, log_path=log_path, env=env, port=port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process_group(proc)


@contextmanager
def sim_engine(args: list[str], *, log_path: Path, env: Mapping[str, str] | None = None) -> Iterator[tuple[str, int]]:
    """`python -m spectune_sim ARGS` on a free port of 127.0.0.1, once /health_generate answers:
    yields (its URL, its process group); stopped afterwards."""
    port = free_port()
    argv = [sys.executable, "-m", "spectune_sim", *args, "--host", "127.0.0.1", "--port", str(port)]
    proc = spawn(argv, log_path, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(f"{url}/health_generate", proc, log_path, timeout=300)
        yield url, proc.pid
    finally:
        stop_process_group(proc)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() else json.dumps(key)


def _toml_table(values: Mapping[str, object]) -> str:
    return "".join(f"{_toml_key(k)} = {_toml_value(v)}\n" for k, v in values.items())


def sim_worker_toml(
    *,
    api_url: str,
    worker_id: str,
    models: Mapping[str, str | Path],
    top: Mapping[str, object] | None = None,
    engine: Mapping[str, object] | None = None,
    engine_env: Mapping[str, str] | None = None,
    timeouts: Mapping[str, float] | None = None,
    labels: Mapping[str, str] | None = None,
) -> str:
    """The TOML of a worker whose engine is the simulator (`module = "spectune_sim"`, this Python,
    SGLang 0.5.23, a free port), reading its token from `token` next to the file.

    `top`, `engine`, `timeouts` add or override keys of those tables; the simulator reads its
    landscape from a model path's last folder, so `models` maps registry names to such folders.
    """
    engine_table = {
        "python": sys.executable,
        "module": "spectune_sim",
        "sglang_version": "0.5.23",
        "port": free_port(),
        **(engine or {}),
    }
    parts = [
        _toml_table({"api_url": api_url, "token_file": "token", "worker_id": worker_id, **(top or {})}),
        "\n[engine]\n" + _toml_table(engine_table),
    ]
    if engine_env:
        parts.append("\n[engine.env]\n" + _toml_table(engine_env))
    if timeouts:
        parts.append("\n[timeouts]\n" + _toml_table(timeouts))
    parts.append("\n[models]\n" + _toml_table(models))
    if labels:
        parts.append("\n[labels]\n" + _toml_table(labels))
    return "".join(parts)


def write_token(folder: Path, token: str) -> None:
    """The worker's token file (`token_file = "token"`), mode 0600 as the worker demands."""
    (folder / "token").write_text(token + "\n")
    (folder / "token").chmod(0o600)


@contextmanager
def study_lock_held(db_url: str, study: str) -> Iterator[psycopg.Connection[Any]]:
    """The study's lock, held by another transaction (as an ask or a report of that study holds it)."""
    dbname = db_url.rsplit("/", 1)[1]
    conn = psycopg.connect(f"host=127.0.0.1 port=5432 user=postgres dbname={dbname}")
    try:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (advisory_lock_key(f"study:{study}"),))
        yield conn
    finally:
        conn.rollback()
        conn.close()


def ok_result(tok_s: float = 100.0) -> dict[str, Any]:
    """A lease's successful report body: one level (concurrency 1) at `tok_s` output tokens/s."""
    return {"outcome": "ok", "metrics": {"levels": [{"concurrency": 1, "output_tok_s": tok_s}]}}


def run_threads(fn: Any, n: int) -> list[Any]:
    """Run fn(i) in n threads released at the same instant; return results in order."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


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
