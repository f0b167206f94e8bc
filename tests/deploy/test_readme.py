"""The README's blocks run exactly as printed: the REST session and the API host's deployment
(bash, a real `spectune server`, loopback only)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.db import pg_clone
from tests.support.helpers import copy_checkout, free_port, wait_for
from tests.support.specs import small_spec

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"


def bash_block(after: str) -> str:
    """The README's first bash block after the text `after`."""
    text = README.read_text(encoding="utf-8")
    m = re.compile(r"```bash\n(.*?)```", re.S).search(text, text.index(after))
    assert m is not None, f"the README lost its bash block after {after!r}"
    return m.group(1)


def rest_session() -> str:
    return bash_block("An example session")


def test_readme_rest_session_runs_as_printed(tmp_path: Path) -> None:
    block = rest_session()
    assert "sleep 3" not in block and "/healthz" in block
    # `spectune` from this interpreter's environment, first on PATH; PORT picks a free loopback port.
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PORT": str(free_port()),
        "TZ": "UTC",
    }
    env.pop("SPECTUNE_DATABASE_URL", None)
    proc = subprocess.Popen(
        ["bash", "-e", "-c", block],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # The block ends with `kill $SERVER`; make sure nothing of its group outlives the test anyway.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-3000:]
    # The baseline, then SGLang's default 3/1/4 as the first trial.
    assert '"kind": "trial"' in out and '"num_steps": 3' in out
    # The study document, printed whole by json.tool: the trial is the best so far (94 / 90).
    start = out.index('{\n    "name": "demo"')
    shown, end = json.JSONDecoder().raw_decode(out[start:])
    assert shown["best"]["speedup"] == pytest.approx(94.0 / 90.0)
    assert shown["deployment"]["launch_command"].startswith("python -m sglang.launch_server")
    # (the server's access log shares the terminal: skip to the list that follows)
    rest = out[start + end :]
    trials, _ = json.JSONDecoder().raw_decode(rest, rest.index("\n[\n") + 1)
    assert [t["state"] for t in trials][:1] == ["COMPLETE"]


def deployment_block() -> str:
    return bash_block("## Running a real deployment")


@pytest.fixture
def empty_pg_database() -> Iterator[str]:
    with pg_clone(None) as url:
        yield url


def test_readme_deployment_installs_the_api_host_as_printed(tmp_path: Path, empty_pg_database: str) -> None:
    """The API host's block, as printed: `make dist`, a clean venv, the `server` extra, schema,
    tokens, server.  No torch and no CUDA wheel come with it, the server answers, and a study
    asking for the `gp` sampler (which needs torch) gets a 422 that says what to install."""
    block = deployment_block()
    assert "spectune[" not in block and "make dist" in block
    checkout = copy_checkout(tmp_path / "checkout")
    venv = tmp_path / "venv"
    port = free_port()
    env = {
        **os.environ,
        # python3 and make from this environment; the block makes its own venv from that python.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "VENV": str(venv),
        "SPECTUNE_DATABASE_URL": empty_pg_database,
        "BIND": "127.0.0.1",
        "PORT": str(port),
        "TZ": "UTC",
    }
    env.pop("PYTHONPATH", None)
    log = tmp_path / "block.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", "-e", "-c", block], cwd=checkout, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    api = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            try:
                return httpx.get(f"{api}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for("the API host's install and server", up, 900, interval=1.0)
        # Three tokens were printed, one line each (admin, user, worker).
        printed = log.read_text(errors="replace")
        listed = subprocess.run(
            [str(venv / "bin" / "pip"), "list", "--format", "json"], capture_output=True, text=True, check=True, env=env
        )
        names = {d["name"].lower().replace("_", "-") for d in json.loads(listed.stdout)}
        assert {"spectune", "fastapi", "optuna", "psycopg", "uvicorn"} <= names
        cuda = sorted(n for n in names if n in ("torch", "triton") or (n.startswith("nvidia-") and n != "nvidia-ml-py"))
        assert cuda == [], cuda
        user = subprocess.run(
            [str(venv / "bin" / "spectune"), "token", "create", "--role", "user"],
            capture_output=True, text=True, check=True, env=env, cwd=tmp_path,
        ).stdout.strip()  # fmt: skip
        h = {"Authorization": f"Bearer {user}"}
        r = httpx.post(f"{api}/v1/studies", json=small_spec("wants-gp", sampler="gp"), headers=h, timeout=30)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["field"] == "sampler" and "[server,gp]" in r.json()["error"]["message"]
        r = httpx.post(f"{api}/v1/studies", json=small_spec("auto-ok"), headers=h, timeout=30)
        assert r.status_code == 201, r.text
        assert printed.count("\n") >= 3
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
