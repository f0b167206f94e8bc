"""`spectune demo`, the README's first command, end to end (shortened to a few trials)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cluster import SERVER_PID_RE, alive, group_alive

pytestmark = pytest.mark.slow


def test_demo_runs_a_study_prints_the_answer_and_cleans_up(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    r = subprocess.run(
        # A generous deadline: on a busy machine the demo is slower, not wrong.  The time-out only
        # guards against a hang; the demo's children follow it if it is killed (workers/lifeline.py).
        [sys.executable, "-m", "api.cli", "demo", "--workdir", str(workdir), "--trials", "4", "--deadline-s", "1500"],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    result = json.loads((workdir / "result.json").read_text())
    if result["study"]["outcome"] == "no_answer":
        # A host too loaded to measure (the demo's engines share it with the suite): the demo says
        # so first, as `study best` does, and prints no command to deploy.
        assert "no answer: the answer's measurement saturated" in out and "No command to launch" in out
        assert "python -m sglang.launch_server" not in out
    else:
        assert "the speed without speculation" in out and "95% interval" in out
        _command_is_printed_under_its_load(out, workdir)
        assert "confirmed" in out  # the answer was re-measured next to a fresh baseline
    assert result["study"]["state"] == "finished"
    measured = [t for t in result["trials"] if t["state"] == "COMPLETE" and t["duplicate_of"] is None]
    assert len(measured) == 4
    # Every engine the two workers started is gone, and so are the workers' process groups.
    pids = {int(p) for log in workdir.glob("worker-*/worker.log") for p in SERVER_PID_RE.findall(log.read_text())}
    assert pids, "the workers should have launched engines"
    for pid in pids:
        assert not alive(pid) and not group_alive(pid), f"engine {pid} outlived the demo"


def result_load_line(workdir: Path) -> str:
    """The deployment's load line as the demo stored it in result.json."""
    return str(json.loads((workdir / "result.json").read_text())["study"]["deployment"]["load_line"])


def _command_is_printed_under_its_load(out: str, workdir: Path) -> None:
    """The command to launch is the study's deployment (with speculation when it pays, else
    without), and the line right above it says the loads it was proven at and what it admits."""
    result = json.loads((workdir / "result.json").read_text())
    lines = out.splitlines()
    launch = next(line for line in lines if "python -m sglang.launch_server" in line)
    assert "--tp-size 8" in launch  # the moe-pcie landscape is a 1T MoE at TP8 (it printed 1)
    if result["study"]["speculation_pays"]:
        assert "--speculative-algorithm EAGLE3" in launch
        # Sized to the one load measured: one request at a time, said in the singular.
        assert result_load_line(workdir) == "proven at concurrency 1; admits at most 1 running request"
    else:
        assert "--speculative" not in launch and "speculation does not pay here" in out
    # The adaptive answer's command starts with the `cat >` of its config file.
    first = next(i for i, line in enumerate(lines) if "python -m sglang.launch_server" in line or "cat > " in line)
    above = lines[first - 1].strip()
    assert above == "# " + result_load_line(workdir), above
    assert above.startswith("# proven at concurrency 1") and "; admits " in above
