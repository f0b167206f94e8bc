"""Issue 35, for real: the API process, real worker processes and the simulated engine on Postgres.

1. A stolen unbound worker token, alone, next to two honest workers (each with a token of its
   own), reports the numbers the review forged (baselines at 0.001 tok/s, or far above the
   fleet's, and every trial and confirmation at 1e9): it cannot move the study's answer beyond the
   plausibility bound, and cannot make the study say "confirmed" on its own word.
2. A spec whose workload does not fit its context (`context_length: 128`, `input_len: 4096`): the
   engine answers 400, the worker names the spec field, the study stops, the host stays healthy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from optimizer.plausibility import SPEEDUP_OVER_ACCEPT
from tests.e2e.test_study_runs import MODELS, spec
from tests.support.cluster import Cluster, cluster
from tests.support.helpers import wait_for
from tests.support.specs import INVENTORY

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

LIARS = ("liar-1", "liar-2", "liar-3", "liar-4")


class StolenToken:
    """One unbound worker token speaking as several worker ids, forging every report."""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.h = {"Authorization": f"Bearer {c.new_token('worker', 'stolen')}"}
        self.turn = 0
        self.reports: list[tuple[str, str, str]] = []  # (worker, kind, the state the API answered)

    def step(self) -> None:
        worker = LIARS[self.turn % len(LIARS)]
        self.turn += 1
        r = httpx.post(f"{self.c.api_url}/v1/workers/{worker}/lease", headers=self.h, json=INVENTORY, timeout=30)
        if r.status_code != 200:
            return
        lease = r.json()
        if lease["kind"] == "baseline":
            # As the review did (0.001), or far above what the honest hosts measure.
            tok_s = 0.001 if worker in ("liar-1", "liar-2") else 1e6
        else:
            tok_s = 1e9
        levels = [{"concurrency": c, "output_tok_s": tok_s} for c in lease["workload"]["concurrency"]]
        body = {"outcome": "ok", "metrics": {"levels": levels}}
        done = httpx.post(
            f"{self.c.api_url}/v1/leases/{lease['lease_id']}/complete", headers=self.h, json=body, timeout=60
        )
        assert done.status_code == 200, done.text
        self.reports.append((worker, lease["kind"], done.json()["state"]))


def test_a_stolen_token_cannot_move_the_answer_nor_confirm_it(pg_db_url: str, tmp_path: Path) -> None:
    with cluster(tmp_path, pg_db_url) as c:
        c.create_study(spec("victim", 4))
        liar = StolenToken(c)
        for _ in range(len(LIARS)):
            liar.step()  # first in: the liar's baselines come before any honest one
        c.add_worker("gpu-a", MODELS)
        c.add_worker("gpu-b", MODELS)

        def finished() -> dict[str, Any] | None:
            liar.step()
            st = c.study("victim")
            return st if st["state"] != "running" else None

        def where() -> str:
            st = c.study("victim")
            fleet = {w: (f["state"], (f.get("current_lease") or {}).get("kind")) for w, f in c.fleet().items()}
            return f"{st['state']} {st['phase']} {st['trials']} {st['eligibility']} {fleet} {liar.reports[-6:]}"

        st = wait_for("the study to finish", finished, timeout=200, interval=0.5, context=where)
        trials = c.trials("victim")

    assert st["state"] == "finished", st
    # The liar did get work, and every trial or confirmation it reported was quarantined.  Its 0.001
    # baselines too; those of 1e6 taken before any honest host had measured one stand (no consensus
    # to weigh them against yet), but nothing measured against them passes the accept-length bound.
    assert any(kind != "baseline" for _, kind, _ in liar.reports), liar.reports
    assert all(state == "failed" for _, kind, state in liar.reports if kind != "baseline"), liar.reports
    assert all(state == "failed" for w, _, state in liar.reports if w in ("liar-1", "liar-2")), liar.reports
    # No value the liar reported was scored: every measured trial is an honest host's, and within
    # the bound the accept length sets.
    measured = [t for t in trials if t["state"] == "COMPLETE" and t["speedup"] is not None]
    assert measured
    for t in measured:
        assert t["worker_id"] in ("gpu-a", "gpu-b"), t
        assert t["speedup"] <= (t["config"]["num_steps"] + 1) * SPEEDUP_OVER_ACCEPT, t
    winner = st["winner"]
    assert winner is not None and winner["speedup"] < 10
    # "Confirmed" only on an honest host that did not find it.
    if winner["confirmed"]:
        assert winner["confirmed_on"] in ("gpu-a", "gpu-b") and winner["confirmed_on"] != winner["search_worker_id"]
    else:
        assert "confirmed against" not in st["verdict"]
    assert not any(w in st["verdict"] for w in LIARS), st["verdict"]


def test_a_workload_longer_than_its_context_stops_the_study_and_spares_the_host(pg_db_url: str, tmp_path: Path) -> None:
    doc = spec("ctx", 2)
    doc["model"] = {**doc["model"], "context_length": 128}
    doc["workload"] = {**doc["workload"], "input_len": 4096}
    with cluster(tmp_path, pg_db_url) as c:
        c.create_study(doc)
        c.add_worker("gpu-a", MODELS)
        st = wait_for("the study to stop", lambda: (s := c.study("ctx"))["state"] != "running" and s, timeout=180)
        fleet, leases = c.fleet(), c.leases("ctx")

    assert st["state"] == "stopped", st
    assert "workload.input_len 4096" in st["finish_reason"] and "model.context_length 128" in st["finish_reason"]
    assert fleet["gpu-a"]["state"] == "ok", fleet["gpu-a"]
    (base,) = leases
    failure = base["result"]["failure"]
    assert (failure["kind"], failure["spec_field"]) == ("request_rejected", "workload.input_len"), failure
