"""The one rule every launch of a study is judged by (optimizer.decide, issue 31 item 3)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from optimizer import decide
from optimizer.policy import DEFAULT_POLICY
from optimizer.space import SpecConfig
from optimizer.spec import parse_spec
from tests.support.search import frozen_trial, trial_attrs

OFF = dataclasses.replace(DEFAULT_POLICY, per_cost=False)


def spec() -> Any:
    return parse_spec({"name": "d", "model": {"target": "t", "draft": "d"}, "seed": 3, "sampler": "auto"})


def measured(startup: dict[int, float]) -> list[Any]:
    """Launches of dense-8b-h100 at concurrency 1 whose start-up grows with the draft steps."""
    out = []
    for i, steps in enumerate(sorted(startup)):
        cfg = SpecConfig(num_steps=steps, topk=1, num_draft_tokens=steps + 1)
        a = trial_attrs("dense-8b-h100", cfg, [1], startup_s=startup[steps])
        out.append(frozen_trial(i, a["speedup_by_level"]["1"], a))
    return out


def test_a_move_is_worth_its_launch_when_its_chance_per_typical_launch_reaches_p_matters() -> None:
    p = DEFAULT_POLICY.p_matters
    cheap = decide.Move(decide.Purpose.SEARCH, "a", 1.5 * p)
    dear = decide.Move(decide.Purpose.SEARCH, "b", 1.5 * p, cost=2.0)
    assert decide.worth(cheap, DEFAULT_POLICY)
    # Twice the GPU-seconds: the same chance buys half as much per second.
    assert not decide.worth(dear, DEFAULT_POLICY)
    assert decide.worth(dataclasses.replace(dear, chance=2.0 * p), DEFAULT_POLICY)


def test_costs_are_gpu_seconds_against_the_studys_typical_launch() -> None:
    sp = spec()
    trials = measured({1: 300.0, 3: 380.0, 5: 460.0})
    shallow = SpecConfig(num_steps=1, topk=1, num_draft_tokens=2)
    deep = SpecConfig(num_steps=9, topk=1, num_draft_tokens=10)
    rel = decide.prices(sp, trials).relative([shallow, deep], np.array([1.5, 1.5]))
    # Start-up grows by ~40 s a step: the deep one costs more than the study's typical launch, the
    # shallow one less.
    assert rel[0] < 1.0 < rel[1]
    # A slower configuration benchmarks longer: the same start-up at half the speed costs more.
    slow = decide.prices(sp, trials).relative([shallow], np.array([0.75]))
    assert slow[0] > rel[0]
    # A baseline launches the weights alone and benchmarks at 1.0x.
    assert 0.0 < decide.prices(sp, trials).baseline() < 1.5


def test_off_or_before_any_launch_every_launch_costs_the_same() -> None:
    sp = spec()
    trials = measured({1: 300.0, 5: 460.0})
    deep = [SpecConfig(num_steps=9, topk=1, num_draft_tokens=10)]
    assert decide.prices(sp, trials, OFF).relative(deep, np.array([1.0])).tolist() == [1.0]
    assert decide.prices(sp, trials, OFF).baseline() == 0.0
    assert decide.prices(sp, []).relative(deep, np.array([1.0])).tolist() == [1.0]
    assert decide.prices(sp, []).baseline() == 1.0
