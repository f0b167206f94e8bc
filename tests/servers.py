"""Real API server processes for tests (uvicorn through `spectune server`), on 127.0.0.1 only."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

from workers.lifeline import child_env

REPO = Path(__file__).resolve().parent.parent


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def api_server(
    db_url: str, *, log_path: Path, env: Mapping[str, str] | None = None, port: int | None = None
) -> Iterator[str]:
    """Start `spectune server` and yield its base URL; stop it (SIGTERM, then SIGKILL) afterwards."""
    port = port or free_port()
    artifacts = str(log_path.parent / "artifacts")
    full_env = {**os.environ, "TZ": "UTC", "SPECTUNE_ARTIFACT_DIR": artifacts, **(env or {})}
    argv = [
        sys.executable,
        "-m",
        "api.cli",
        "server",
        "--database-url",
        db_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=child_env(full_env), start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"API server exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"API server not ready in 60 s: {log_path.read_text()[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        stop_process_group(proc)


def stop_process_group(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
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
