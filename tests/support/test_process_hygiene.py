"""A pytest run stopped by SIGTERM (a `timeout` around it, a cancelled CI job) still kills what
its tests started: tests/conftest.py turns the signal into an unwinding exception."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.helpers import wait_for

REPO = Path(__file__).resolve().parents[2]

INNER = """
import os, signal, subprocess, sys, time

def test_holds_a_server():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        with open(os.environ["HYGIENE_PIDFILE"], "w") as f:
            f.write(str(child.pid))
        time.sleep(600)
    finally:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait()
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_pytest_runs_every_teardown(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    pidfile = tmp_path / "child.pid"
    env = {**os.environ, "HYGIENE_PIDFILE": str(pidfile)}
    pytest_proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
         str(tmp_path / "test_inner.py")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    child = 0
    try:
        wait_for("the inner test's server", lambda: pidfile.exists() and pidfile.read_text() != "", 120)
        child = int(pidfile.read_text())
        assert alive(child)
        pytest_proc.send_signal(signal.SIGTERM)
        out, _ = pytest_proc.communicate(timeout=120)
        assert not alive(child), f"the inner test's server outlived a SIGTERM to pytest:\n{out.decode()[-2000:]}"
        assert pytest_proc.returncode != 0
    finally:
        for pid in (child, pytest_proc.pid):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        pytest_proc.wait()
