"""The README's REST session, run exactly as printed (bash, a real `spectune server`, loopback only)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import free_port

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parent.parent / "README.md"


def rest_session() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("An example session")
    m = re.compile(r"```bash\n(.*?)```", re.S).search(text, start)
    assert m is not None, "the README lost its REST session"
    return m.group(1)


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
