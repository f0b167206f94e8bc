"""The model rule asks what one launch can move the answer by (issue 31 item 3: the deployed
answer's improvement, not a configuration's): optimizer.gains.moved_sd, stop_rules.launch_variance."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from optimizer import attrs as A
from optimizer import convergence, stop_rules
from optimizer.gains import moved_sd
from optimizer.model_sampler import objective_levels, observations_of
from optimizer.perf_model import Candidates, FittedModel, fit
from optimizer.policy import DEFAULT_POLICY
from optimizer.space import SpecConfig
from tests.optimizer.test_convergence import measured, spec

# dense-8b-h100 at concurrency 1, measured where the sampler went in its first eight asks.
EIGHT = [
    SpecConfig(num_steps=a, topk=b, num_draft_tokens=c)
    for a, b, c in [(3, 1, 4), (5, 4, 8), (3, 8, 64), (7, 8, 50), (7, 4, 22), (6, 4, 19), (6, 4, 20), (6, 4, 18)]
]


def test_one_launch_moves_the_model_less_the_noisier_it_is() -> None:
    sd = np.array([0.01, 0.02, 0.04])
    assert np.allclose(moved_sd(sd, 0.0), sd)  # a noiseless launch shows the value itself
    assert np.allclose(moved_sd(sd, 0.02**2)[1], 0.02 / math.sqrt(2.0))  # as noisy as unsure: 1/sqrt(2)
    quiet, loud = moved_sd(sd, 0.01**2), moved_sd(sd, 0.05**2)
    assert np.all(loud < quiet) and np.all(quiet < sd)


def test_a_launchs_noise_is_the_prediction_checks_terms() -> None:
    # No launch yet: the measurement floor and a host's offset.
    assert math.isclose(stop_rules.launch_variance([]), DEFAULT_POLICY.measurement_floor**2 + DEFAULT_POLICY.host_sd**2)
    trials = measured("dense-8b-h100", EIGHT)
    wide = dataclasses.replace(DEFAULT_POLICY, host_sd=0.05)
    # The host's part is the policy's; the measured part is the same whatever the host.
    gap = stop_rules.launch_variance(trials, wide) - stop_rules.launch_variance(trials)
    assert math.isclose(gap, 0.05**2 - DEFAULT_POLICY.host_sd**2)
    spreads = sorted(stop_rules.measurement_sd(A.TrialRecord(t)) for t in trials)
    own = stop_rules.launch_variance(trials) - DEFAULT_POLICY.host_sd**2
    assert spreads[0] ** 2 - 1e-12 <= own <= spreads[-1] ** 2 + 1e-12


def test_the_model_rule_stops_where_no_launch_can_move_the_answer_by_min_gain() -> None:
    # A fleet whose launches land 5% apart (host_sd): the model still sees a 34% chance that a
    # configuration left beats the incumbent by 1%, but one launch of it could not show that.
    trials = measured("dense-8b-h100", EIGHT)
    noisy = dataclasses.replace(DEFAULT_POLICY, host_sd=0.05)
    off = convergence.assess(spec(), trials, dataclasses.replace(noisy, answer_moves=False))
    on = convergence.assess(spec(), trials, noisy)
    assert not off.settled and off.best_chance >= noisy.p_matters, off.reason
    assert on.settled and on.rule is stop_rules.StopRule.MODEL and on.best_chance < noisy.p_matters, on.reason
    assert "chance to show it beats" in on.reason
    # With the default host offset, it asks less of the same study, but a launch still may.
    quiet = convergence.assess(spec(), trials)
    assert not quiet.settled and quiet.best_chance < off.best_chance


def test_where_nothing_pays_the_rule_weighs_the_value_not_a_launch_of_it() -> None:
    """The preposterior adds a launch's noise to what the model is unsure of about the value: the
    sd it starts from is the value's (`new_launch=False`), not a measurement's, which holds the
    host offset and launch noise already (counted twice, the rule would stop sooner than it says)."""
    trials = measured("no-gain", EIGHT)
    model = fit(observations_of(trials), 10)
    assert model is not None
    levels, weights = objective_levels(spec())
    cand = Candidates.of(
        [SpecConfig(num_steps=2, topk=1, num_draft_tokens=3), SpecConfig(num_steps=4, topk=2, num_draft_tokens=8)]
    )
    m_launch, sd_launch = model.predict_log_speedup(cand, levels, weights)
    m_value, sd_value = model.predict_log_speedup(cand, levels, weights, new_launch=False)
    assert np.allclose(m_launch, m_value)
    assert np.all(sd_value <= sd_launch) and np.any(sd_value < sd_launch)


def test_the_rule_asks_the_value_where_it_adds_a_launchs_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []
    real = FittedModel.predict_log_speedup

    def spy(self: FittedModel, *args: Any, **kw: Any) -> Any:
        if kw.get("with_sd", True):  # the means alone (a launch's predicted cost) ask no sd
            asked.append(bool(kw.get("new_launch", True)))
        return real(self, *args, **kw)

    monkeypatch.setattr(FittedModel, "predict_log_speedup", spy)
    trials = measured("no-gain", EIGHT)
    a = convergence.assess(spec(), trials)
    assert a.pays is not True and asked and asked[-1] is False, a.reason
    asked.clear()
    convergence.assess(spec(), trials, dataclasses.replace(DEFAULT_POLICY, answer_moves=False))
    assert asked[-1] is True
