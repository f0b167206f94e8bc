"""`spectune server --workers N`: several API processes on one port, on Postgres only.

One Python process is one core's worth of API under load (issue 18's 300 studies and 40 clients:
98% of a core, /healthz waiting behind request threads for the GIL).  The processes share
everything through Postgres; each stops when the supervisor is gone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from api.cli.admin import _listening_socket
from tests.support.api_client import make_tokens
from tests.support.helpers import free_port, spawn_api, stop_process_group, wait_for
from tests.support.specs import small_spec
from workers.launcher.processes import descendants

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def _api_processes(supervisor: int) -> set[int]:
    """The supervisor's children that serve the app (uvicorn's spawned processes)."""
    found = set()
    for pid in descendants([supervisor]):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing" in cmd and b"resource_tracker" not in cmd:
            found.add(pid)
    return found


def test_two_api_processes_serve_one_port_and_share_the_database(pg_db_url: str, tmp_path: Path) -> None:
    tokens = make_tokens(pg_db_url)
    port = free_port()
    proc = spawn_api(pg_db_url, log_path=tmp_path / "api.log", port=port, workers=2)
    try:
        wait_for("two API processes", lambda: len(_api_processes(proc.pid)) == 2 or None, 60)
        api = f"http://127.0.0.1:{port}"
        user = {"Authorization": f"Bearer {tokens['user']}"}
        r = httpx.post(f"{api}/v1/studies", json=small_spec("shared"), headers=user, timeout=30)
        assert r.status_code == 201, r.text
        # Fresh connections land on either process; every one sees the study the other created,
        # and a second create of the name is refused whichever process takes it.
        for _ in range(10):
            with httpx.Client(timeout=30) as c:
                got = c.get(f"{api}/v1/studies/shared", headers=user)
                assert got.status_code == 200 and got.json()["name"] == "shared", got.text
        again = httpx.post(f"{api}/v1/studies", json=small_spec("shared"), headers=user, timeout=30)
        assert again.status_code == 409, again.text
        # The supervisor killed outright: its processes follow it (workers/lifeline.py).
        served = _api_processes(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

        def gone() -> bool | None:
            return all(not Path(f"/proc/{pid}").exists() for pid in served) or None

        wait_for("the API processes to follow their supervisor", gone, 60)
    finally:
        stop_process_group(proc)


def test_more_than_one_process_needs_postgres(tmp_path: Path) -> None:
    from api.schema import upgrade

    url = f"sqlite:///{tmp_path / 'spectune.db'}"
    upgrade(url)
    r = subprocess.run(
        [sys.executable, "-m", "api.cli", "server", "--database-url", url, "--port", str(free_port()), "--workers", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "--workers 2 needs Postgres" in r.stderr and "Traceback" not in r.stderr


def test_the_shared_port_is_a_tcp_socket_so_asyncio_turns_nagle_off() -> None:
    # uvicorn's own socket has protocol 0, and asyncio sets TCP_NODELAY only on IPPROTO_TCP
    # sockets: every keep-alive response's body then waited ~40 ms for the client's delayed ACK.
    sock = _listening_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP and sock.get_inheritable()
        sock.listen()
        client = socket.create_connection(sock.getsockname(), timeout=10)
        conn, _ = sock.accept()
        try:
            assert conn.proto == socket.IPPROTO_TCP  # what asyncio checks on each accepted connection
        finally:
            conn.close()
            client.close()
    finally:
        sock.close()


def test_a_server_freezes_its_startup_heap_out_of_the_collectors_scans(tmp_path: Path) -> None:
    # Full collections under load held the GIL 260-1080 ms with the startup heap in them.
    import gc

    from api.app import create_app, freeze_startup_heap
    from tests.support.api_client import make_settings

    gc.unfreeze()
    try:
        app = create_app(make_settings(f"sqlite:///{tmp_path / 'x.db'}"), check_schema=False)
        assert freeze_startup_heap(app) is app
        frozen = gc.get_freeze_count()
        assert frozen > 10_000, frozen  # the modules, Optuna, SQLAlchemy, pydantic: not a handful
    finally:
        gc.unfreeze()
