"""Plausibility before trust, and confirmations only from another token (issue 35 items 1).

Seen on cc094f3: one stolen unbound worker token, as `liar-1`, completed a baseline at 0.001 tok/s
and its trials at 1e9; as `liar-2` (the same token) a baseline at 0.001 and the confirmation at
1e9: two users' studies finished "speculation pays ... 999999999999.999x (confirmed against a
fresh baseline on liar-2)".  Each reproduction here failed there.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from optimizer import conductor as c
from optimizer import plausibility as P
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec, Workload
from optimizer.study_state import Phase, StudyState
from tests.support.api_client import Api
from tests.support.helpers import ok_result
from tests.support.specs import INVENTORY, small_spec

CFG = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)


def level(tok_s: float, al: float | None = None) -> P.Level:
    return P.Level(1, tok_s, al)


# ------------------------------------------------------------------ the bounds, alone


def test_a_speedup_above_the_accept_length_is_impossible() -> None:
    assert P.speedup_problem(CFG, [level(250.0, 2.5)], {1: 100.0}) is None
    assert "accept length" in (P.speedup_problem(CFG, [level(500.0, 2.5)], {1: 100.0}) or "")
    # Without an accept length, the most the steps allow (steps + 1) bounds it.
    assert P.speedup_problem(CFG, [level(550.0)], {1: 100.0}) is None
    assert P.speedup_problem(CFG, [level(1e9)], {1: 100.0}) is not None
    # An accept length above steps + 1 is itself impossible.
    assert "draft steps" in (P.speedup_problem(CFG, [level(150.0, 9.0)], {1: 100.0}) or "")


def test_a_baseline_far_off_other_hosts_or_its_own_is_implausible() -> None:
    peers = [{1: 5992.0}, {1: 6100.0}]
    assert P.baseline_problem([level(5000.0)], peers, None) is None
    assert "other hosts" in (P.baseline_problem([level(0.001)], peers, None) or "")
    # One other token decides nothing: a liar first on a study must not condemn the honest hosts.
    assert P.baseline_problem([level(2353.0)], [{1: 1e6}], None) is None
    assert P.baseline_problem([level(2527.0)], [{1: 1e6}, {1: 2353.0}], None) is None
    assert "earlier" in (P.baseline_problem([level(0.5)], [], {1: 100.0}) or "")
    assert P.baseline_problem([level(90.0)], [], {1: 100.0}) is None


def test_a_rate_too_low_for_the_time_the_lease_lasted_is_implausible() -> None:
    w = Workload(output_len=32, num_prompts=4, repeats=1)
    assert P.pace_problem(w, [level(100.0)], elapsed_s=1.0) is None
    assert "lease lasted" in (P.pace_problem(w, [level(0.001)], elapsed_s=1.0) or "")


def test_a_forged_confirmed_speedup_does_not_break_the_resolve_order() -> None:
    """On cc094f3 a stored 1e12 confirmation made every later confirm lease answer 500: the
    conductor built a Resolve with that threshold, which failed its own validation."""
    spec = StudySpec.model_validate(small_spec("forged"))
    now = datetime(2026, 12, 4, tzinfo=UTC)
    levels = [{"concurrency": 1, "output_tok_s": 1e9, "output_tok_s_runs": [1e9]}]
    base_levels = [{"concurrency": 1, "output_tok_s": 0.001, "output_tok_s_runs": [0.001]}]
    forged = c.LeaseView("l1", "confirm", "completed", trial_number=0, measurement=(levels, base_levels))
    other = c.LeaseView("l2", "confirm", "queued", trial_number=1)
    base = c.Baseline(1, "w1", now - timedelta(seconds=5), {1: 100.0}, levels=base_levels)
    snap = c.Snapshot(
        spec=spec, state=StudyState.RUNNING, phase=Phase.CONFIRMATION, created_at=now, now=now,
        trials=(), launched=frozenset(), leases=[forged, other], baselines=[base], hosts=[], timing=c.Timing(),
    )  # fmt: skip
    order = c.resolve_order(snap, other, base)
    assert max(order.thresholds) <= 1000


# ------------------------------------------------------------------ through the API


def new_worker_token(api: Api, name: str) -> str:
    from api.auth import create_token
    from api.db import make_engine, make_sessionmaker

    engine = make_engine(api.db_url or "")
    try:
        return create_token(make_sessionmaker(engine), "worker", name)[1]
    finally:
        engine.dispose()


class Liar:
    """One stolen unbound worker token speaking as any worker id."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.h = {"Authorization": f"Bearer {new_worker_token(api, 'stolen')}"}

    def ask(self, worker: str) -> dict[str, Any] | None:
        r = self.api.client.post(f"/v1/workers/{worker}/lease", headers=self.h, json=INVENTORY)
        assert r.status_code in (200, 204), r.text
        return r.json() if r.status_code == 200 else None

    def report(self, lease: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        r = self.api.client.post(f"/v1/leases/{lease['lease_id']}/complete", headers=self.h, json=body)
        assert r.status_code == 200, r.text
        return dict(r.json())


def honest(api: Api, worker: str, tok_s: float) -> dict[str, Any]:
    lease = api.post(f"/v1/workers/{worker}/lease", "fleet", INVENTORY).json()
    r = api.post(f"/v1/leases/{lease['lease_id']}/complete", "fleet", ok_result(tok_s))
    assert r.status_code == 200, r.text
    return dict(lease)


def test_the_liars_baseline_is_quarantined_with_its_reason_and_never_stored(api: Api) -> None:
    assert api.post("/v1/studies", "user", small_spec("victim")).status_code == 201
    assert honest(api, "gpu-a", 5992.0)["kind"] == "baseline"
    liar = Liar(api)
    lease = liar.ask("liar-1")
    assert lease is not None and lease["kind"] == "baseline"
    out = liar.report(lease, ok_result(0.001))
    assert out["state"] == "failed"
    # Recorded and shown: the reason on the lease's report, as an event, and on the host.
    from sqlalchemy import select

    from api.db import make_engine, make_sessionmaker
    from api.models import BaselineRow, EventRow, LeaseRow

    engine = make_engine(api.db_url or "")
    try:
        with make_sessionmaker(engine)() as s:
            assert s.scalars(select(BaselineRow).where(BaselineRow.worker_id == "liar-1")).all() == []
            row = s.get(LeaseRow, lease["lease_id"])
            assert row is not None and row.result is not None
            assert "lease lasted" in row.result["implausible"]
            assert row.result["reported"]["metrics"]["levels"][0]["output_tok_s"] == 0.001
            kinds = s.scalars(select(EventRow.kind).where(EventRow.lease_id == lease["lease_id"])).all()
            assert "implausible_report" in kinds
    finally:
        engine.dispose()
    # The host pays, as for any host failure: three in a row quarantine it.
    (w,) = [w for w in api.get("/v1/workers", "user").json() if w["id"] == "liar-1"]
    assert w["consecutive_host_failures"] == 1
    assert [f["lease_id"] for f in w["recent_failures"]] == [lease["lease_id"]]


def test_a_trial_above_the_accept_length_bound_is_not_scored_and_is_retried(api: Api) -> None:
    assert api.post("/v1/studies", "user", small_spec("victim")).status_code == 201
    liar = Liar(api)
    base = liar.ask("liar-1")
    assert base is not None and liar.report(base, ok_result(100.0))["state"] == "completed"
    trial = liar.ask("liar-1")
    assert trial is not None and trial["kind"] == "trial"
    out = liar.report(trial, ok_result(1e9))
    assert out["state"] == "failed" and out["speedup"] is None
    trials = {t["number"]: t for t in api.get("/v1/studies/victim/trials", "user").json()}
    assert trials[trial["trial_number"]]["state"] == "RUNNING"  # never told to Optuna as a value
    assert honest(api, "gpu-a", 100.0)["kind"] == "baseline"
    retry = api.post("/v1/workers/gpu-a/lease", "fleet", INVENTORY).json()
    assert retry["trial_number"] == trial["trial_number"] and retry["attempt"] == 2
    shown = api.get("/v1/studies/victim", "user").json()
    assert (shown.get("best") or {}).get("speedup") is None


def _drive(api: Api, study: str, ask: Any, report: Any, workers: list[str], tok_s: float, rounds: int = 200) -> None:
    """Hand out and report leases round-robin until the study ends (bounded)."""
    for i in range(rounds):
        if api.get(f"/v1/studies/{study}", "user").json()["state"] != "running":
            return
        w = workers[i % len(workers)]
        lease = ask(w)
        if lease is None:
            continue
        report(lease, ok_result(tok_s * (1.0 if lease["kind"] == "baseline" else 1.5)))
    raise AssertionError(f"study {study} still running after {rounds} leases")


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_one_token_as_two_worker_ids_cannot_make_a_study_say_confirmed(api: Api) -> None:
    """The liar as liar-1 and liar-2, alone on a study, with numbers inside every bound: the answer
    is its word only, and says so; never "confirmed"."""
    spec = small_spec("alone", budget={"max_trials": 3})
    assert api.post("/v1/studies", "user", spec).status_code == 201
    liar = Liar(api)
    _drive(api, "alone", liar.ask, liar.report, ["liar-1", "liar-2"], 100.0)
    shown = api.get("/v1/studies/alone", "user").json()
    winner = shown["winner"]
    assert winner is not None and winner["confirmed"] is False
    assert "one token serves this study" in winner["not_independent"]
    assert "confirmed" not in shown["verdict"], shown["verdict"]
    assert "0 confirmed" in shown["finish_reason"] and "re-measured only" in shown["finish_reason"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_study_served_by_two_tokens_is_confirmed_by_the_other(api: Api) -> None:
    spec = small_spec("pair", budget={"max_trials": 3})
    assert api.post("/v1/studies", "user", spec).status_code == 201

    def ask(w: str) -> dict[str, Any] | None:
        r = api.post(f"/v1/workers/{w}/lease", "fleet", INVENTORY)
        return r.json() if r.status_code == 200 else None

    def report(lease: dict[str, Any], body: dict[str, Any]) -> None:
        assert api.post(f"/v1/leases/{lease['lease_id']}/complete", "fleet", body).status_code == 200

    _drive(api, "pair", ask, report, ["gpu-a", "gpu-b"], 100.0)
    winner = api.get("/v1/studies/pair", "user").json()["winner"]
    assert winner["confirmed"] is True and winner["not_independent"] is None
    assert winner["confirmed_on"] != winner["search_worker_id"]
