"""End to end on Postgres: the API process, worker processes and the simulated engine.

What a cluster throws at spectune, for real: a whole study, a worker killed with SIGKILL in the
middle of a trial, the API going away during a benchmark, SIGTERM during start-up, and
configurations that run out of memory.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import Cluster, alive, cluster, group_alive
from tests.support.helpers import wait_for
from tests.support.specs import small_spec

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

MODELS = {"moe-pcie": "moe-pcie", "moe-pcie-eagle3": "moe-pcie-eagle3"}


def spec(name: str, max_trials: int, **kw: Any) -> dict[str, Any]:
    workload = {"output_len": 48, "num_prompts": 4, "concurrency": [1, 2], "warmup_requests": 1, "repeats": 2}
    return small_spec(name, **{"workload": workload, "budget": {"max_trials": max_trials}, "seed": 11, **kw})


def finished(c: Cluster, name: str) -> dict[str, Any] | None:
    st = c.study(name)
    return st if st["state"] != "running" else None


def test_two_workers_run_a_ten_trial_study(pg_db_url: str, tmp_path: Path) -> None:
    with cluster(tmp_path, pg_db_url) as c:
        # A fixed budget of ten (the convergence stop would end it earlier: tests/optimizer/test_convergence.py).
        c.create_study(spec("e2e-ten", 10, budget={"max_trials": 10, "converge": False}))
        c.add_worker("gpu-a", MODELS)
        c.add_worker("gpu-b", MODELS)
        st = wait_for("the study to finish", lambda: finished(c, "e2e-ten"), timeout=240, interval=1.0)
        assert st["state"] == "finished", st
        trials = c.trials("e2e-ten")
        leases = c.leases("e2e-ten")

    # Ten restarts: each launched configuration finished measured, or pruned after a level
    # that could no longer reach the best (never answered from another trial or inferred).
    launched = [t for t in trials if t["duplicate_of"] is None and t.get("inferred_from") is None
                and t["state"] in ("COMPLETE", "PRUNED")]  # fmt: skip
    assert len(launched) == st["configurations_launched"] == 10
    measured = [t for t in launched if t["state"] == "COMPLETE"]
    for t in [t for t in launched if t["state"] == "PRUNED"]:
        assert t["levels"] and [lv["concurrency"] for lv in t["levels"]] == [1], t
    for t in measured:
        assert t["feasible"], t
        assert [lv["concurrency"] for lv in t["levels"]] == [1, 2], t
        assert all(lv["output_tok_s"] > 0 and lv["accept_length"] > 1.0 for lv in t["levels"])
        eff, cfg = t["effective"], t["config"]
        # What ran is what SGLang (the simulator) reported after start-up.
        assert eff["speculative_num_steps"] == cfg["num_steps"]
        assert eff["speculative_eagle_topk"] == cfg["topk"]
        assert eff["speculative_num_draft_tokens"] == cfg["num_draft_tokens"]
        assert t["startup_s"] > 0
    # Each worker measured its own baseline before its first trial.
    for worker in ("gpu-a", "gpu-b"):
        mine = [le for le in leases if le["worker_id"] == worker]
        assert mine and mine[0]["kind"] == "baseline" and mine[0]["state"] == "completed"
    # `best` is the answer (the confirmed winner); the search's own best is `best_measured`.
    assert st["best"] is not None and st["best"] == st["winner"]
    assert st["best_measured"]["speedup"] == max(t["speedup"] for t in measured)
    # The printed command is the deployment's: speculative exactly when the answer says it pays (a
    # busy host can leave this small-gain engine's verdict at "does not pay" with honest intervals).
    dep = st["deployment"]
    assert dep is not None and st["best"]["launch_command"] == dep["launch_command"]
    assert ("--speculative-num-steps" in dep["launch_command"]) == dep["speculation"], st["verdict"]


def test_sigkilled_worker_trial_is_rerun_by_the_other_exactly_once(pg_db_url: str, tmp_path: Path) -> None:
    with cluster(tmp_path, pg_db_url, lease_ttl_s=4.0) as c:
        # Long benchmarks so the kill lands mid-trial.
        c.create_study(
            spec("e2e-kill", 3, workload={"output_len": 400, "num_prompts": 4, "concurrency": [1], "repeats": 2})
        )
        a = c.add_worker("gpu-a", MODELS)
        b_started = False

        def a_in_trial() -> dict[str, Any] | None:
            cur = c.fleet().get("gpu-a", {}).get("current_lease")
            return cur if cur and cur["kind"] == "trial" else None

        victim = wait_for("gpu-a to hold a trial", a_in_trial, timeout=90)
        wait_for("gpu-a's engine to serve", lambda: "server ready" in a.log_text().split(victim["lease_id"])[-1], 60)
        assert a.proc is not None
        os.kill(a.proc.pid, signal.SIGKILL)  # no goodbye, no report
        a.proc.wait(timeout=10)
        b = c.add_worker("gpu-b", MODELS)
        b_started = True

        def rerun_done() -> bool:
            ls = [le for le in c.leases("e2e-kill") if le["trial_number"] == victim["trial_number"]]
            return any(le["state"] == "completed" for le in ls)

        wait_for("the killed trial to be re-run and completed", rerun_done, timeout=180, interval=0.5)
        leases = [le for le in c.leases("e2e-kill") if le["trial_number"] == victim["trial_number"]]
        trials = {t["number"]: t for t in c.trials("e2e-kill")}
        assert b_started and b.proc is not None

    states = sorted((le["worker_id"], le["state"], le["attempt"]) for le in leases)
    assert states == [("gpu-a", "expired", 1), ("gpu-b", "completed", 2)], states
    told = trials[victim["trial_number"]]
    assert told["state"] == "COMPLETE" and told["worker_id"] == "gpu-b"
    completed_for_trial = [le for le in leases if le["state"] == "completed"]
    assert len(completed_for_trial) == 1


def test_api_down_during_benchmark_result_arrives_from_outbox(pg_db_url: str, tmp_path: Path) -> None:
    with cluster(tmp_path, pg_db_url, lease_ttl_s=60.0) as c:
        c.create_study(
            spec("e2e-outbox", 1, workload={"output_len": 400, "num_prompts": 4, "concurrency": [1], "repeats": 2})
        )
        w = c.add_worker("gpu-a", MODELS)

        def in_trial_benchmark() -> dict[str, Any] | None:
            cur = c.fleet().get("gpu-a", {}).get("current_lease")
            if cur and cur["kind"] == "trial" and "server ready" in w.log_text().split(cur["lease_id"])[-1]:
                return cur
            return None

        lease = wait_for("gpu-a to benchmark a trial", in_trial_benchmark, timeout=90)
        c.stop_api()
        wait_for(
            "the finished report to wait in the outbox", lambda: "stays in the outbox" in w.log_text(), timeout=120
        )
        assert list(w.outbox.glob("*.json")), "the finished report must be on disk while the API is down"
        c.start_api()
        wait_for("the queued report to be delivered", lambda: not list(w.outbox.glob("*.json")), timeout=60)
        trials = {t["number"]: t for t in c.trials("e2e-outbox")}

    told = trials[lease["trial_number"]]
    assert told["state"] == "COMPLETE" and told["levels"][0]["output_tok_s"] > 0


def test_sigterm_during_startup_reports_the_lease_and_leaves_no_process(pg_db_url: str, tmp_path: Path) -> None:
    with cluster(tmp_path, pg_db_url) as c:
        c.create_study(spec("e2e-term", 2))
        # Slow start-up (about 30 s of modelled capture at this scale) so SIGTERM lands during it.
        w = c.add_worker("gpu-a", MODELS, {"SPECTUNE_SIM_TIME_SCALE": "0.05"}, startup_s=120)

        def launching_trial() -> dict[str, Any] | None:
            cur = c.fleet().get("gpu-a", {}).get("current_lease")
            if cur and cur["kind"] == "trial" and f"lease {cur['lease_id']}: launching" in w.log_text():
                return cur
            return None

        # The baseline start-up is slow too; let the worker get through it.
        lease = wait_for("gpu-a to start launching a trial", launching_trial, timeout=150, interval=0.5)
        time.sleep(1.0)
        engine_pids = w.engine_pids()
        assert engine_pids, "the engine should have been started"
        assert w.proc is not None
        os.killpg(w.proc.pid, signal.SIGTERM)
        assert w.proc.wait(timeout=60) == 0
        leases = [le for le in c.leases("e2e-term") if le["id"] == lease["lease_id"]]

    assert leases[0]["state"] == "failed"
    assert leases[0]["result"]["failure"]["kind"] == "lost"
    assert "shutting down" in leases[0]["result"]["failure"]["message"]
    for pid in engine_pids:
        assert not alive(pid) and not group_alive(pid), f"engine {pid} survived the worker's shutdown"


def test_oom_config_is_reported_and_the_worker_goes_on(pg_db_url: str, tmp_path: Path) -> None:
    models = {"big-moe": "mem-tight", "big-moe-eagle3": "mem-tight-eagle3"}
    # A 24 GB host: capturing graphs up to batch 64 leaves no room for a wide tree.
    oom = {"num_steps": 8, "topk": 8, "num_draft_tokens": 64, "cuda_graph_max_bs": 64}
    with cluster(tmp_path, pg_db_url) as c:
        c.create_study(
            spec(
                "e2e-oom", 3,
                model={"target": "big-moe", "draft": "big-moe-eagle3"},
                search_space={"num_steps": {"low": 1, "high": 8}, "topk": [1, 2, 4, 8], "num_draft_tokens": {"low": 2, "high": 64},
                              "cuda_graph_max_bs": [64]},
                warm_start=[oom],
            )
        )  # fmt: skip
        c.add_worker("gpu-a", models)
        st = wait_for("the study to finish", lambda: finished(c, "e2e-oom"), timeout=180, interval=1.0)
        trials = c.trials("e2e-oom")

    first = trials[0]
    assert first["config"] == oom
    assert first["failure_kind"] == "oom" and first["feasible"] is False
    others = [t for t in trials[1:] if t["state"] == "COMPLETE" and t["feasible"]]
    assert others, "after the OOM the worker must go on to the next lease"
    assert st["best"]["trial_number"] != first["number"]
