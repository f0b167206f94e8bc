"""End to end: an adaptive answer is launched exactly as printed (issue 17 items 1, 3).

The real API on Postgres, a real worker and the simulated engine on `split-load`, where a chain
pays 1.8x alone and every configuration loses from 4 running requests on: no single
configuration pays over both levels, so the answer is SGLang's adaptive mode (drafting at batch
1, steps 0 at 4).  The study's last confirmation starts that server; the command `study best`
prints is the command line the engine received, but for the config file's path: the printed
command writes `spectune_adaptive_spec.json` in the working directory, the worker wrote the same
text to its own file next to the launch log.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from optimizer.answer import ADAPTIVE_FILE
from tests.support.cluster import Cluster, cluster
from tests.support.helpers import wait_for
from tests.support.specs import split_load_spec

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

MODELS = {"split-load": "split-load", "split-load-eagle3": "split-load-eagle3"}


def spec(name: str) -> dict[str, Any]:
    return split_load_spec(name, output_len=96)


def finished(c: Cluster, name: str) -> dict[str, Any] | None:
    st = c.study(name)
    return st if st["state"] != "running" else None


def cli(c: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPECTUNE_API_URL": c.api_url, "SPECTUNE_TOKEN": c.tokens["user"], "TZ": "UTC"}
    env.pop("SPECTUNE_DATABASE_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_the_adaptive_answer_is_the_command_its_confirmation_launched(pg_db_url: str, tmp_path: Path) -> None:
    with cluster(tmp_path, pg_db_url) as c:
        # Slower than other e2e tests' engine and without its modelled noise: a single 96-token stream
        # at 40x lasts milliseconds, and a busy 2-core host then measures its own timer.
        w = c.add_worker("gpu-a", MODELS, {"SPECTUNE_SIM_SPEED": "10", "SPECTUNE_SIM_NOISE": "0"})
        # A CI box running the rest of the suite beside this one can oversubscribe the host while the
        # answer is measured; the worker then marks it saturated (workers/loadgen/saturation.py) and
        # the product rightly prints no command (exit 4).  That is the host, not the answer: the same
        # study is run once more, and only if the host saturated that one too is the test skipped.
        for attempt in range(2):
            name, logged = f"e2e-adaptive-{attempt}", len(w.log_text())
            c.create_study(spec(name))
            st = wait_for("the study to finish", functools.partial(finished, c, name), timeout=180, interval=1.0)
            if not _saturated_answer(st):
                break
            # This run's part of the log: the worker saw the saturation that made this answer none.
            assert "saturated measurement" in w.log_text()[logged:], "no answer, but the worker saw no saturation"
        else:
            pytest.skip(f"the host saturated the answer's measurement twice: {st['verdict']}")
        leases = c.leases(name)
        best = cli(c, "study", "best", name, "--worker-config", str(w.config), "--port", _port(w.config))
        shown = cli(c, "study", "show", name)
    assert st["state"] == "finished", st
    dep = st["deployment"]
    assert dep["mode"] == "adaptive", (st["verdict"], st["best_by_level"], st["launch_noise"])
    # The answer's proof is the last confirmation: the adaptive server, completed, its lease named.
    confirms = [le for le in leases if le["kind"] == "confirm"]
    # On a busy host an adaptive start can time out; it is then retried in a smaller envelope, and
    # the answer is the launch that completed.
    proofs = [le for le in confirms if le["trial_number"] is None and le["state"] == "completed"]
    assert len(proofs) == 1, (confirms, st["verdict"])
    (proof,) = proofs
    assert proof["state"] == "completed", confirms
    assert all(le["leased_at"] <= proof["leased_at"] for le in confirms), confirms
    assert dep["proven_by"] == proof["id"] and proof["id"] in st["verdict"], st["verdict"]
    assert dep["adaptive_config"]["4"] == {"candidate_steps": [0]}, dep["adaptive_config"]
    assert dep["adaptive_config"]["1"]["candidate_steps"][0] > 0
    # The answer's numbers are that launch's: speculation alone; at 4 about the baseline's speed,
    # where any static configuration of this engine runs at half of it or less (steps 0 there).
    measured = {lv["concurrency"]: lv["output_tok_s"] for lv in proof["result"]["metrics"]["levels"]}
    base = {lv["concurrency"]: lv["output_tok_s"] for lv in proof["result"]["confirmation"]["baseline_levels"]}
    assert measured[1] > 1.3 * base[1] and measured[4] > 0.8 * base[4], (measured, base)
    assert f"{proof['result']['confirmation']['speedup']:.3f}x" in st["verdict"]
    # `study best` prints the command the engine received, with the worker's model paths.
    assert best.returncode == 0, best.stderr
    assert f"launched exactly as printed (lease {proof['id']})" in best.stderr
    printed = best.stdout.strip().splitlines()
    assert printed[0] == f"cat > {ADAPTIVE_FILE} <<'EOF'" and printed[2] == "EOF"
    server_args = shlex.split(printed[-1])
    assert server_args[:3] == ["python", "-m", "sglang.launch_server"]
    seen, written = _engine_argv(w.log.parent / "logs")
    assert seen[1:3] == ["-m", "spectune_sim"]
    config_at = seen.index("--speculative-adaptive-config") + 1
    # The only difference: where the config file is (the worker's own file; the user's working directory).
    assert seen[3:config_at] + [ADAPTIVE_FILE] + seen[config_at + 1 :] == server_args[3:]
    assert json.loads(printed[1]) == json.loads(written) == dep["adaptive_config"]
    # One record (item 5): best is that launch, its number on show's best line; the static winner
    # is shown only as the best static configuration.
    assert st["best"] == st["winner"] and st["best"]["adaptive"] and st["best"]["lease_id"] == proof["id"]
    assert st["best_static"] is not None and not st["best_static"]["adaptive"]
    assert shown.returncode == 0 and proof["id"] in shown.stdout, shown.stdout
    (best_line,) = [line for line in shown.stdout.splitlines() if line.startswith("best ")]
    assert f"{st['best']['speedup']:.3f}x" in best_line and "adaptive" in best_line, shown.stdout
    assert "the best static configuration" in shown.stdout


def _saturated_answer(st: dict[str, Any]) -> bool:
    """The study's answer exists but its measurement saturated the host (api/outcomes.py)."""
    return st["outcome"] == "no_answer" and st["deployment"] is not None and st["best"] is not None


def _port(worker_toml: Path) -> str:
    return str(tomllib.loads(worker_toml.read_text())["engine"]["port"])


def _engine_argv(log_dir: Path) -> tuple[list[str], str]:
    """The command line the adaptive server received (the simulator logs it), and its config file."""
    # The last adaptive launch is the one that completed (an earlier start may have failed).
    configs = sorted(log_dir.glob("server-*.adaptive.json"), key=lambda p: p.stat().st_mtime)
    assert configs, list(log_dir.iterdir())
    configs = configs[-1:]
    log = configs[0].with_name(configs[0].name.removesuffix(".adaptive.json") + ".log").read_text()
    m = re.search(r"launch_command=(.*)", log)
    assert m is not None, log[-2000:]
    return shlex.split(m.group(1)), configs[0].read_text()
