"""`spectune demo`, the README's first command, end to end (shortened to a few trials)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e_support import SERVER_PID_RE, alive, group_alive

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
    assert "the speed without speculation" in out, out[-3000:]
    assert "confirmed" in out, out[-3000:]  # the answer was re-measured next to a fresh baseline
    answer = result["study"]["winner"] or result["study"]["best"]
    if any(lv.get("saturated") for lv in answer.get("levels") or []):
        # A busy machine: the engine waited for a CPU, and the host check (workers/loadgen/
        # saturation.py) holds the answer back and says why, claiming no interval and no gain
        # (issue 35: an interval was asserted, and the test failed on a busy 2-core box).
        assert "no answer:" in out and "saturated" in out, out[-3000:]
        assert not result["study"]["speculation_pays"]
    else:
        assert "95% interval" in out, out[-3000:]
    # The command to launch is the study's deployment: with speculation when it pays, else without.
    launch = next(line for line in out.splitlines() if "python -m sglang.launch_server" in line)
    assert "--tp-size 8" in launch  # the moe-pcie landscape is a 1T MoE at TP8 (it printed 1)
    if result["study"]["speculation_pays"]:
        assert "--speculative-algorithm EAGLE3" in launch
    else:
        assert "--speculative" not in launch and "speculation does not pay here" in out
    assert result["study"]["state"] == "finished"
    measured = [t for t in result["trials"] if t["state"] == "COMPLETE" and t["duplicate_of"] is None]
    assert len(measured) == 4
    # Every engine the two workers started is gone, and so are the workers' process groups.
    pids = {int(p) for log in workdir.glob("worker-*/worker.log") for p in SERVER_PID_RE.findall(log.read_text())}
    assert pids, "the workers should have launched engines"
    for pid in pids:
        assert not alive(pid) and not group_alive(pid), f"engine {pid} outlived the demo"
