"""Regression: concurrent asks on SQLite must never hand out one trial twice.

What was seen (issue 11): with two simulated workers on SQLite, trial 0 (SGLang's default 3/1/4,
enqueued as a warm start) was told FAIL as a "duplicate" of itself 58 ms after it started while
its lease stayed active; every progress call then answered 409, the worker abandoned the work,
asked again, got the same lease back and relaunched the server, 115 times.  Two concurrent asks
had popped the same enqueued trial, because Optuna's SQLite engine did not take the write lock up
front.  This reproduces it without engines: 8 workers with baselines ask at the same moment, on a
real `spectune server` process (its thread pool serves the asks concurrently).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.support.helpers import ok_result, run_threads
from tests.support.specs import INVENTORY, small_spec

N_WORKERS = 8
ROUNDS = 3


def test_concurrent_asks_never_hand_out_one_trial_twice(server: Any, tmp_path: Path) -> None:
    base, tokens = server
    log = tmp_path / "api.log"
    user = {"Authorization": f"Bearer {tokens['user']}"}
    worker = {"Authorization": f"Bearer {tokens['worker']}"}
    statuses: Counter[int] = Counter()

    def lease(i: int) -> dict[str, Any] | None:
        r = httpx.post(f"{base}/v1/workers/w{i}/lease", json=INVENTORY, headers=worker, timeout=120)
        statuses[r.status_code] += 1
        return r.json() if r.status_code == 200 else None

    def post(path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
        return httpx.post(f"{base}{path}", json=body, headers=headers, timeout=120)

    # Every worker measures its baseline once (the baseline key is shared by the studies below).
    assert post("/v1/studies", small_spec("warm"), user).status_code == 201
    for b in run_threads(lease, N_WORKERS):
        assert b is not None and b["kind"] == "baseline"
        assert post(f"/v1/leases/{b['lease_id']}/complete", ok_result(100.0), worker).status_code == 200
    assert post("/v1/studies/warm/stop", None, user).status_code == 200

    for round_ in range(ROUNDS):
        name = f"race{round_}"
        assert post("/v1/studies", small_spec(name, budget={"max_trials": 20}), user).status_code == 201
        got = [t for t in run_threads(lease, N_WORKERS) if t is not None]
        assert got, "no worker got work"
        numbers = Counter(t["trial_number"] for t in got)
        assert max(numbers.values()) == 1, f"one trial handed to several workers: {numbers}"
        trials = {t["number"]: t for t in httpx.get(f"{base}/v1/studies/{name}/trials", headers=user).json()}
        for t in got:
            told = trials[t["trial_number"]]
            # A leased trial is still running: nothing may finish it behind its worker's back.
            assert told["state"] == "RUNNING", told
        for t in trials.values():
            assert t.get("duplicate_of") != t["number"], f"trial {t['number']} is a duplicate of itself"
        # The warm start (3/1/4) is handed out exactly once.
        warm = [t for t in got if t["config"]["num_steps"] == 3 and t["config"]["topk"] == 1]
        assert len(warm) == 1, got
        for t in got:
            r = post(f"/v1/leases/{t['lease_id']}/complete", ok_result(101.0), worker)
            assert r.status_code == 200, r.text
        assert post(f"/v1/studies/{name}/stop", None, user).status_code == 200

    assert set(statuses) <= {200, 204}, statuses
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
