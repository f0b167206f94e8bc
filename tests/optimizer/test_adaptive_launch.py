"""The adaptive answer's launch (issue 17 items 1, 3): the conductor queues it as the last proof,
exactly the printed server, and launches none when there is no adaptive answer.  What the study
document reads of it: tests/api/test_adaptive_answer.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from optuna.trial import FrozenTrial

from optimizer import attrs as A
from optimizer import conductor as c
from optimizer import deploy
from optimizer.space import SpecConfig
from optimizer.study_state import Ending, FinishReason
from tests.optimizer.test_conductor import BASES, T0, _settled, finished, snap, spec_of

CHAIN = SpecConfig(num_steps=2, topk=1, num_draft_tokens=3)
OTHER = SpecConfig(num_steps=1, topk=1, num_draft_tokens=2)


def _levels(by_level: dict[int, float]) -> list[dict[str, Any]]:
    return [
        {"concurrency": lv, "output_tok_s": 100 * v, "output_tok_s_runs": [100 * v * f for f in (0.999, 1.0, 1.001)]}
        for lv, v in by_level.items()
    ]


def split(number: int, config: SpecConfig, by_level: dict[int, float]) -> FrozenTrial:
    """A chain that pays alone and loses at 4 (geometric mean below 1)."""
    return finished(
        number,
        (by_level[1] * by_level[4]) ** 0.5,
        {
            A.CONFIG: config.model_dump(mode="json"),
            A.CONFIG_KEY: config.key,
            A.WORKER_ID: "w1",
            A.SPEEDUP_BY_LEVEL: {str(k): v for k, v in by_level.items()},
            A.LEVELS: _levels(by_level),
            A.BASELINE_LEVELS: _levels({1: 1.0, 4: 1.0}),
        },
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
