"""The adaptive answer's launch (issue 17 items 1, 3): the conductor queues it, the study
document reads what became of it (api/services/adaptive_answer.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from optuna.trial import FrozenTrial, TrialState

from api.models import LeaseRow
from api.services.adaptive_answer import outcome
from optimizer import attrs as A
from optimizer import conductor as c
from optimizer import deploy
from optimizer.space import SpecConfig
from optimizer.study_state import Ending, FinishReason
from tests.test_conductor import BASES, T0, _settled, snap, spec_of

CHAIN = SpecConfig(num_steps=2, topk=1, num_draft_tokens=3)
OTHER = SpecConfig(num_steps=1, topk=1, num_draft_tokens=2)


def _levels(by_level: dict[int, float]) -> list[dict[str, Any]]:
    return [
        {"concurrency": lv, "output_tok_s": 100 * v, "output_tok_s_runs": [100 * v * f for f in (0.999, 1.0, 1.001)]}
        for lv, v in by_level.items()
    ]


def split(number: int, config: SpecConfig, by_level: dict[int, float]) -> FrozenTrial:
    """A chain that pays alone and loses at 4 (geometric mean below 1)."""
    return FrozenTrial(
        number=number,
        state=TrialState.COMPLETE,
        value=(by_level[1] * by_level[4]) ** 0.5,
        datetime_start=T0,
        datetime_complete=T0,
        params={},
        distributions={},
        user_attrs={
            A.CONFIG: config.model_dump(mode="json"),
            A.CONFIG_KEY: config.key,
            A.WORKER_ID: "w1",
            A.SPEEDUP_BY_LEVEL: {str(k): v for k, v in by_level.items()},
            A.LEVELS: _levels(by_level),
            A.BASELINE_LEVELS: _levels({1: 1.0, 4: 1.0}),
        },
        system_attrs={},
        intermediate_values={},
        trial_id=number,
    )


TRIALS = [split(0, CHAIN, {1: 1.6, 4: 0.5}), split(1, OTHER, {1: 1.3, 4: 0.6})]
SPEC: dict[str, Any] = {"workload": {"concurrency": [1, 4]}, "budget": {"max_trials": 30}}


def test_a_search_that_does_not_pay_over_both_levels_launches_the_adaptive_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = spec_of("adaptive-nopay", **SPEC)
    monkeypatch.setattr(c.convergence, "assess", lambda spec, trials: _settled(False))
    action = c.settle(snap(spec, TRIALS, baselines=BASES))
    # "Does not pay" over both levels, but the chain pays alone: its adaptive server is launched.
    assert isinstance(action, c.StartConfirmation), action
    assert action.ending.reason == FinishReason.DOES_NOT_PAY
    (proof,) = action.candidates
    assert proof.adaptive and proof.trial_number is None and proof.envelope is not None
    server = proof.envelope.settings
    assert server.adaptive is not None and server.adaptive.steps_by_batch == {1: 2, 4: 0}
    assert server.speculative == CHAIN and server.max_running_requests == 4
    # Exactly the printed server: the planned deployment's settings.
    planned = deploy.adaptive_plan(
        spec, c.answers.adaptive_export(spec, TRIALS, c.launch_noise(snap(spec, TRIALS)).variance)
    )
    assert planned == server


def test_with_candidates_to_confirm_the_adaptive_proof_comes_last(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spec_of("adaptive-pays", **SPEC, confirmation={"top": 2})
    monkeypatch.setattr(c.convergence, "assess", lambda spec, trials: _settled(True))
    action = c.settle(snap(spec, TRIALS, baselines=BASES))
    assert isinstance(action, c.StartConfirmation)
    assert [x.adaptive for x in action.candidates][-1] is True
    assert all(not x.adaptive for x in action.candidates[:-1]) and action.candidates[:-1]
    # Queued together, the adaptive one (no trial number) is handed out after the candidates.
    queued = [
        c.LeaseView(f"l{i}", "confirm", "queued", trial_number=x.trial_number, created_at=T0)
        for i, x in enumerate(reversed(action.candidates))
    ]
    confirming = snap(
        spec, TRIALS, baselines=(*BASES, c.Baseline(9, "w2", T0 + timedelta(minutes=1), {1: 100.0, 4: 100.0})),
        leases=queued, phase=c.Phase.CONFIRMATION, confirmation_began_at=T0, now=T0 + timedelta(minutes=2),
    )  # fmt: skip
    first = c.next_action(confirming, "w2")
    assert isinstance(first, c.Confirm) and first.lease_id != "l0", first


def test_no_adaptive_answer_no_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spec_of("adaptive-none", **SPEC)
    monkeypatch.setattr(c.convergence, "assess", lambda spec, trials: _settled(False))
    losing = [split(0, CHAIN, {1: 0.9, 4: 0.5})]
    # A study that confirms nothing (confirmation.top 0) launches no proof either.
    unconfirmed = spec_of("adaptive-top0", **SPEC, confirmation={"top": 0})
    assert isinstance(c.settle(snap(unconfirmed, TRIALS, baselines=BASES)), c.Finish)
    assert c.settle(snap(spec, losing, baselines=BASES)) == c.Finish(
        Ending(FinishReason.DOES_NOT_PAY, "the rule's words")
    )


def _row(state: str, id_: str = "a1", **kw: Any) -> LeaseRow:
    return LeaseRow(id=id_, state=state, kind="confirm", payload={"confirm": {"adaptive": True}}, **kw)


def test_the_document_reads_the_launch_pending_failed_or_proven() -> None:
    spec = spec_of("adaptive-doc", **SPEC)
    planned = deploy.plan_deployment(
        spec, CHAIN, pays=False, exported=c.answers.adaptive_export(spec, TRIALS), version="0.5.23"
    )
    assert planned is not None and planned.mode == "adaptive"
    assert outcome(spec, planned, [], [], 0.0, "0.5.23") == type(outcome(spec, planned, [], [], 0.0, "0.5.23"))()
    pending = outcome(spec, planned, [_row("queued")], [], 0.0, "0.5.23")
    assert pending.pending is not None and "a1" in pending.pending and pending.proven is None
    failed = outcome(
        spec, planned, [_row("failed")], ["the adaptive deployment did not start (out of GPU memory at start-up)"], 0.0,
        "0.5.23",
    )  # fmt: skip
    assert failed.fallback is not None and "out of GPU memory" in failed.fallback and "falls back" in failed.fallback
    server = planned.settings.model_dump(mode="json")
    done = _row(
        "completed",
        "a2",
        worker_id="w2",
        result={
            "metrics": {"levels": _levels({1: 1.55, 4: 0.99}), "sglang_version": "0.5.23"},
            "confirmation": {"baseline_levels": _levels({1: 1.0, 4: 1.0})},
            "deployment": {"server": server, "adaptive": True},
        },
    )
    proven = outcome(spec, planned, [_row("failed"), done], [], 0.0, "0.5.23")
    assert proven.proven is not None and proven.proven.proven_by == "a2"
    assert proven.proven.command() == planned.command(), "the proven command is the printed one"
    assert proven.verdict is not None and "lease a2 on w2" in proven.verdict
    assert "1: 1.550x" in proven.verdict and "4: 0.990x" in proven.verdict
