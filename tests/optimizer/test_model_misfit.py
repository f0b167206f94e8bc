"""The performance model on engines it was not written beside (issue 31 items 1 and 3).

The model's fixed form (optimizer.perf_model) cannot express every engine; what it leaves
unexplained is learnt from the study's own residuals (optimizer.residual_gp), so its intervals
widen where the form is wrong.  And the acquisition does not spend a launch on a configuration its
own model predicts to lose by more than 20% to the best measured (model_sampler.LOSE_BY).
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import optuna
import pytest

from optimizer import attrs as A
from optimizer import study as opt
from optimizer.model_sampler import LOSE_BY
from optimizer.perf_model import Candidates, Observation, accept_lengths, fit
from optimizer.residual_gp import ResidualGP
from optimizer.space import SpecConfig
from optimizer.spec import parse_spec
from tests.support.search import trial_attrs

optuna.logging.set_verbosity(optuna.logging.WARNING)

Z90 = 1.6448536269514722
_LOGIT = math.log(0.75 / 0.25)  # a conditional acceptance of 0.75 at every position


def _al(c: SpecConfig) -> float:
    """Accept length in the model's own form (so only the cost is misfit)."""
    f = np.array
    return float(accept_lengths(f([c.num_steps]), f([c.topk]), f([c.num_draft_tokens]), f([_LOGIT]), 0.15)[0])


def _verify(tokens: int) -> float:
    """Verify cost over a plain decode step in tiles of 16 tokens: nearly flat inside a tile, a
    step of half a decode step at each new one (a knee per tile, which one knee cannot follow)."""
    return 1.0 + 0.01 * (tokens - 1) + 0.5 * math.floor((tokens - 1) / 16)


def _ratio(c: SpecConfig) -> float:
    return c.num_steps * 0.06 * (1 + 0.02 * (c.topk - 1)) + _verify(c.num_draft_tokens) + 0.05


def _configs(spec: list[tuple[int, int, int]]) -> list[SpecConfig]:
    return [SpecConfig(num_steps=s, topk=k, num_draft_tokens=n) for s, k, n in spec]


TRAIN = _configs(
    [(3, 1, 4), (5, 1, 6), (4, 4, 8), (6, 4, 16), (3, 2, 6), (5, 8, 24), (7, 4, 20), (2, 4, 12), (6, 8, 32)]
)
TRAIN += _configs([(4, 8, 40)])
HELD_OUT = _configs([(4, 8, 28), (6, 8, 36), (5, 4, 30), (3, 8, 18), (7, 1, 8), (6, 2, 14), (4, 2, 10), (5, 4, 22)])
HELD_OUT += _configs([(6, 8, 34), (4, 4, 18), (5, 8, 26), (3, 4, 10)])


def test_a_verify_cost_the_form_cannot_follow_widens_the_interval_over_held_out_launches() -> None:
    """Ten launches (1% measurement noise, two hosts) of an engine whose verify cost steps at tiles;
    twelve held-out configurations inside that range.  The fixed form alone claimed ~1.3% sd and
    covered 4 of the 12 (before issue 31); the learnt misfit widens the intervals to hold them."""
    rng = random.Random(5)
    obs = [
        Observation(
            c.num_steps,
            c.topk,
            c.num_draft_tokens,
            1,
            _al(c) * math.exp(rng.gauss(0, 0.01)),
            _ratio(c) * math.exp(rng.gauss(0, 0.01)),
            host=f"h{i % 2}",
        )  # fmt: skip
        for i, c in enumerate(TRAIN)
    ]
    model = fit(obs, max_steps=10)
    assert model is not None and model.cost_gp is not None
    mean, sd = model.predict_log_speedup(Candidates.of(HELD_OUT), [1], [1.0])
    true = np.array([math.log(_al(c) / _ratio(c)) for c in HELD_OUT])
    inside = np.abs(true - mean) <= Z90 * sd
    assert inside.sum() >= 0.75 * len(HELD_OUT), list(zip([c.key for c in HELD_OUT], true - mean, sd, strict=True))
    # The width is the misfit the residuals show, not the parameters' uncertainty alone.
    fixed_only = fit(obs, max_steps=10)
    assert fixed_only is not None
    fixed_only.al_gp = fixed_only.cost_gp = None
    _, sd_fixed = fixed_only.predict_log_speedup(Candidates.of(HELD_OUT), [1], [1.0])
    assert np.median(sd) > 2 * np.median(sd_fixed)
    assert model.cost_gp.expected("amp") > 0.05


def test_a_form_that_fits_keeps_its_intervals_narrow() -> None:
    """The same launches of an engine the form does describe (one knee-free linear verify cost):
    the residuals are measurement noise, and the misfit it learns stays small."""
    rng = random.Random(6)

    def ratio(c: SpecConfig) -> float:
        return c.num_steps * 0.06 * (1 + 0.02 * (c.topk - 1)) + 1.0 + 0.02 * (c.num_draft_tokens - 1) + 0.05

    obs = [
        Observation(
            c.num_steps,
            c.topk,
            c.num_draft_tokens,
            1,
            _al(c) * math.exp(rng.gauss(0, 0.01)),
            ratio(c) * math.exp(rng.gauss(0, 0.01)),
            host=f"h{i % 2}",
        )  # fmt: skip
        for i, c in enumerate(TRAIN)
    ]
    model = fit(obs, max_steps=10)
    assert model is not None and model.cost_gp is not None
    assert model.cost_gp.expected("amp") < 0.05
    mean, sd = model.predict_log_speedup(Candidates.of(HELD_OUT), [1], [1.0])
    true = np.array([math.log(_al(c) / ratio(c)) for c in HELD_OUT])
    assert (np.abs(true - mean) <= Z90 * sd).mean() >= 0.75
    assert np.median(sd) < 0.06


def test_the_residual_mean_bends_towards_a_measured_neighbour() -> None:
    """A residual measured at one point moves the prediction next to it most, and far away least."""
    x = np.array([[0.0, 0.0], [3.0, 0.0]])
    gp = ResidualGP.fit(x, np.array([0.2, 0.0]), np.array([0.01, 0.01]))
    assert gp is not None
    q = np.array([[[0.2, 0.0]], [[6.0, 0.0]]])
    mean, var = gp.moments(q, np.ones((2, 1)))
    assert mean[0] > 0.1 and abs(mean[1]) < 0.05
    assert var[1] > var[0]


def _spec(**kw: Any) -> Any:
    return parse_spec({"name": "misfit", "model": {"target": "t", "draft": "d"}, "seed": 1, "sampler": "auto", **kw})


def _value(a: dict[str, Any]) -> float:
    vals = list(a["speedup_by_level"].values())
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


@pytest.mark.parametrize("landscape", ["no-gain", "moe-pcie", "draft-mem-cliff"])
def test_no_first_proposal_is_one_the_model_expects_to_lose_by_20_percent(landscape: str) -> None:
    """The service's loop in memory (warm starts, then the model's proposals), one launch at a
    time: none of the model's first four proposals is predicted, when it is asked, to lose to the
    best measured by more than LOSE_BY, unless the trial states its purpose.  Before issue 31 the first
    proposal on no-gain was s4-k8-n64 (0.51x predicted against the baseline's 1.0x), on moe-pcie
    s6-k8-n64 (0.61x)."""
    sp = _spec()
    storage = optuna.storages.InMemoryStorage()
    opt.create_study(storage, sp)
    best = 1.0
    proposals = 0
    while proposals < 4:
        study = opt.load_study(storage, sp)
        asked = opt.ask(study, sp)
        t = study._storage.get_trial(asked.trial_id)  # noqa: SLF001 - what the sampler stored on it
        r = A.TrialRecord(t)
        pred = r.model_prediction
        if pred is not None and pred.get("move") != "start":
            proposals += 1
            if r.proposal_purpose is None:
                assert pred["speedup"] >= (1.0 - LOSE_BY) * best, (proposals, asked.config.key, pred, best)
        a = trial_attrs(landscape, asked.config, [1])
        opt.tell_value(study, asked.number, _value(a), 0.0, a)
        best = max(best, _value(a))


def _noisy_fleet(launch_sd: float, host_offsets: tuple[float, ...], n: int = 24) -> tuple[Any, Any, list[str]]:
    """Residuals of `n` launches spread over the hosts: no shape, each host's offset, launch noise."""
    rng = np.random.default_rng(7)
    x = rng.uniform(0.0, 4.0, size=(n, 2))
    hosts = [f"h{i % len(host_offsets)}" for i in range(n)]
    resid = np.array([host_offsets[i % len(host_offsets)] for i in range(n)]) + rng.normal(0.0, launch_sd, n)
    return x, resid, hosts


def test_the_residual_grid_reaches_a_fleet_at_the_top_of_the_stated_ranges() -> None:
    """Issue 31's engines have launch noise of 0.5-4% and host offsets of 0-8%.  A fleet at the top
    of both must be read as noisy, not as a shape to follow: the grid's weight goes to its 4% noise
    and its 8% host offsets (optimizer.policy residual_extra_noise, residual_host_sds).  Cut at
    the ranges' middles, the model put its confidence in single launches, and ranked a host's
    luckiest launch first (benchmarks/README.md "The model's noise grid spans the stated ranges")."""
    x, resid, hosts = _noisy_fleet(0.04, (0.08, -0.08))
    gp = ResidualGP.fit(x, resid, np.full(len(resid), 0.005), hosts=hosts)
    assert gp is not None
    assert gp.expected("extra_noise") > 0.03
    assert gp.expected("host_sd") > 0.05
    # A quiet fleet on one host keeps the grid's low end: the top is there for the data to choose.
    x, resid, hosts = _noisy_fleet(0.003, (0.0,))
    quiet = ResidualGP.fit(x, resid, np.full(len(resid), 0.005), hosts=hosts)
    assert quiet is not None and quiet.expected("extra_noise") < 0.01
