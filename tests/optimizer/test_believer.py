"""The launches in flight believed at the model's predictions (optimizer.believer), and the fleet
holding a launch back when, so believed, they settle the model rule (optimizer.conductor)."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
from optuna.trial import FrozenTrial, TrialState

from optimizer import attrs as A
from optimizer import believer, convergence
from optimizer import conductor as c
from optimizer import stop_rules as R
from optimizer.model_sampler import objective_levels, observations_of
from optimizer.perf_model import Candidates, fit
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from tests.optimizer.test_conductor import FLEET, FLEET_BASES, T0, finished, running, snap, spec_of

BASE_TOK_S = 100.0


def engine(cfg: SpecConfig) -> tuple[float, float]:
    """(accept length, cycle ratio) of a made-up engine, in its own terms: each draft position is
    accepted with 0.7 of the one before, a verify costs 0.08 of a decode step per draft step and
    0.01 per draft token."""
    depth = min(cfg.num_steps, cfg.num_draft_tokens - 1)
    al = 1.0 + sum(0.7**p for p in range(1, depth + 1))
    return al, 1.0 + 0.08 * cfg.num_steps + 0.01 * cfg.num_draft_tokens


def launched(number: int, cfg: SpecConfig, worker: str) -> FrozenTrial:
    al, ratio = engine(cfg)
    user = BASE_TOK_S * al / ratio
    return finished(
        number,
        al / ratio,
        {
            A.CONFIG: cfg.model_dump(mode="json"),
            A.CONFIG_KEY: cfg.key,
            A.WORKER_ID: worker,
            A.LEVELS: [{"concurrency": 1, "output_tok_s": user, "per_user_tok_s": user, "accept_length": al}],
            A.BASELINE_LEVELS: [{"concurrency": 1, "output_tok_s": BASE_TOK_S, "per_user_tok_s": BASE_TOK_S}],
        },
    )


def in_flight(number: int, cfg: SpecConfig, prediction: dict[str, Any] | None) -> FrozenTrial:
    """A launch in flight as the service stores it: the sampler set its configuration and
    prediction at the ask; its host is known only from its lease until it reports."""
    attrs: dict[str, Any] = {A.CONFIG: cfg.model_dump(mode="json"), A.CONFIG_KEY: cfg.key}
    if prediction is not None:
        attrs[A.MODEL_PREDICTION] = prediction
    return running(number, attrs)


MEASURED = [
    launched(i, SpecConfig(num_steps=s, topk=1, num_draft_tokens=s + 1), f"w{i % 4 + 1}")
    for i, s in enumerate((1, 3, 5, 2, 6))
]
PREDICTED = {"speedup": 1.4, "log_sd": 0.05, "move": "model"}
START = {"speedup": 1.3, "log_sd": 0.3, "expected_improvement": None, "p_oom": None, "move": "start"}
DEEP = SpecConfig(num_steps=4, topk=2, num_draft_tokens=8)


def test_a_launch_in_flight_is_believed_at_the_models_fit() -> None:
    """The believed trial reports what the model fitted to the results in would have it measure:
    its speedup is the model's, its accept length is the model's, its host is its lease's, it
    arrives after every real result, it carries no prediction of its own and is marked believed
    (neither the prediction check nor the misfit may score a result that matches the fit by
    construction), and a starting point launched blind is not believed until a model has
    predicted it in flight (optimizer.model_sampler.in_flight_predictions)."""
    spec = spec_of("believe")
    blind = in_flight(6, SpecConfig(num_steps=4, topk=1, num_draft_tokens=5), None)
    trials = [*MEASURED, in_flight(5, DEEP, PREDICTED), blind]
    got = believer.believed(spec, trials, T0 - timedelta(days=1), {5: "w3", 6: "w2"})
    assert got is not None
    by_number = {t.number: t for t in got}
    assert by_number[6].state == TrialState.RUNNING  # blind: left in flight
    t = by_number[5]
    # The caller's clock is a day behind Optuna's stamps: the believed result still comes last.
    assert t.state == TrialState.COMPLETE and t.datetime_complete is not None and t.datetime_complete > T0
    assert [x.number for x in R.launches(got)][-1] == 5
    model = fit(observations_of(MEASURED), spec.search_space.num_steps.high)
    assert model is not None
    levels, weights = objective_levels(spec)
    mean, _ = model.predict_log_speedup(Candidates.of([DEEP]), levels, weights)
    assert t.value is not None and math.isclose(math.log(t.value), float(mean[0]), rel_tol=1e-9, abs_tol=1e-9)
    r = A.TrialRecord(t)
    assert r.model_prediction is None and r.has(A.BELIEVED)
    assert r.config_key == DEEP.key and r.worker_id == "w3"
    assert math.isclose(r.levels[0]["accept_length"], model.accept_length(DEEP), rel_tol=1e-9)
    # The refit sees it as one more observation, and the rule counts it as one more launch.
    assert len(observations_of(got)) == len(observations_of(MEASURED)) + 1
    assert len(R.launches(got)) == len(MEASURED) + 1
    # A start predicted in flight (move "start", nothing but the speedup and its sd) is believed.
    start = in_flight(6, SpecConfig(num_steps=4, topk=1, num_draft_tokens=5), START)
    got = believer.believed(spec, [*MEASURED, start], T0, {6: "w2"})
    assert got is not None and {t.number: t for t in got}[6].state == TrialState.COMPLETE
    # Nothing to believe: no prediction in flight, or no result to fit.
    assert believer.believed(spec, [*MEASURED, blind], T0) is None
    assert believer.believed(spec, [in_flight(0, DEEP, PREDICTED)], T0) is None


def test_a_believed_launch_does_not_shrink_the_models_misfit() -> None:
    """Results the model misses (the engine's values scaled by a zig-zag the fixed form cannot
    follow) widen its intervals (optimizer.residual_gp sizes the misfit on them); adding a believed
    launch, which sits on the fit by construction, leaves that misfit as it was."""
    spec = spec_of("believe-misfit")
    missed = []
    for i, t in enumerate(MEASURED):
        f = 1.15 if i % 2 else 0.87
        lv = dict(t.user_attrs[A.LEVELS][0])
        lv["per_user_tok_s"] = lv["output_tok_s"] = lv["per_user_tok_s"] * f
        missed.append(finished(t.number, float(t.value or 0.0) * f, {**t.user_attrs, A.LEVELS: [lv]}))
    got = believer.believed(spec, [*missed, in_flight(5, DEEP, PREDICTED)], T0, {5: "w1"})
    assert got is not None
    steps = spec.search_space.num_steps.high
    clean, zig, with_believed = (fit(observations_of(ts), steps) for ts in (list(MEASURED), missed, got))
    assert clean is not None and zig is not None and with_believed is not None
    assert clean.cost_gp is not None and zig.cost_gp is not None and with_believed.cost_gp is not None
    # The zig-zag is seen: the misfit's expected size grows ...
    assert zig.cost_gp.expected("amp") > 1.5 * clean.cost_gp.expected("amp")
    # ... and a believed launch, on the fit by construction, does not shrink it (nor acceptance's).
    assert with_believed.cost_gp.expected("amp") == pytest.approx(zig.cost_gp.expected("amp"), rel=1e-9)
    assert zig.al_gp is not None and with_believed.al_gp is not None
    assert with_believed.al_gp.expected("amp") == pytest.approx(zig.al_gp.expected("amp"), rel=1e-9)


def settled_once_believed(chance: float, *, trusted: bool = True) -> Any:
    """A stop rule that settles on the model rule (with `chance` left) once trial 5 is in, and
    is unsure (50%) before."""

    def assess(spec: StudySpec, trials: list[FrozenTrial], *_: object) -> convergence.Assessment:
        check = R.PredictionCheck(6, 1.0 if trusted else 3.0, trusted, None, 0.0, 0.0)
        if any(t.number == 5 and t.state == TrialState.COMPLETE for t in trials):
            return convergence.Assessment(True, "settled", 6, 100, chance, "k", 1.0, True, R.StopRule.MODEL, check)
        return convergence.Assessment(False, "not yet", 5, 100, 0.5, "k", 1.0, None, check=check)

    return assess


@pytest.mark.parametrize(
    ("name", "chance", "trusted", "holds"),
    [
        ("believe-holds", 0.01, True, True),
        # Settled only just under the bar: a result a little below its prediction would not settle it.
        ("believe-marginal", c.BELIEF_MARGIN * convergence.P_MATTERS, True, False),
        # A model that failed its prediction check is not believed.
        ("believe-distrusted", 0.01, False, False),
    ],
)
def test_a_fleet_holds_a_launch_the_believed_launches_in_flight_make_needless(
    monkeypatch: pytest.MonkeyPatch, name: str, chance: float, trusted: bool, holds: bool
) -> None:
    """Four hosts, one model proposal in flight: when the rule, with that launch believed at the
    model's prediction, settles with room to spare, the next host waits for its result; otherwise
    it asks (one more proposal, up to MODEL_PARALLEL)."""
    monkeypatch.setattr(convergence, "assess", settled_once_believed(chance, trusted=trusted))
    trials = [*MEASURED, in_flight(5, DEEP, PREDICTED)]
    lease = c.LeaseView("t5", "trial", "active", 5, worker_id="w1")
    s = snap(spec_of(name), trials, baselines=FLEET_BASES, hosts=FLEET, leases=[lease])
    action = c.next_action(s, "w3")
    if holds:
        assert isinstance(action, c.Wait) and "as the model predicts" in action.reason
    else:
        assert isinstance(action, c.Ask)


def test_without_a_confirmation_a_believed_launch_never_becomes_the_incumbent(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `confirmation.top: 0` the rule settles only on an incumbent whose interval is tight; a
    believed launch has no passes to show its spread, so the rule (optimizer.convergence) never
    counts a believed leader as tight, and one below the best still holds a launch back."""
    # Chains of 1, 2, 3, 6 and 7 steps measured: the engine's best chains (4, 5) are not.
    measured = [
        launched(i, SpecConfig(num_steps=s, topk=1, num_draft_tokens=s + 1), f"w{i % 4 + 1}")
        for i, s in enumerate((1, 2, 3, 6, 7))
    ]
    best = max(float(t.value or 0.0) for t in measured)
    above = [*measured, in_flight(5, SpecConfig(num_steps=5, topk=1, num_draft_tokens=6), PREDICTED)]
    below = [*measured, in_flight(5, SpecConfig(num_steps=1, topk=2, num_draft_tokens=3), PREDICTED)]
    for name, trials, leads in (("believe-top0-below", below, False), ("believe-top0-above", above, True)):
        got = believer.believed(spec_of(name, confirmation={"top": 0}), trials, T0, {5: "w1"})
        assert got is not None
        assert (float(next(t for t in got if t.number == 5).value or 0.0) > best) == leads, name
    # The real rule: a believed leader is "wide" without a confirmation, not with one.
    top0 = spec_of("believe-top0-rule", confirmation={"top": 0})
    got = believer.believed(top0, above, T0, {5: "w1"})
    assert got is not None
    a = convergence.assess(top0, got)
    assert not a.settled and "interval is wider" in a.reason, a.reason
    top2 = spec_of("believe-top2-rule", confirmation={"top": 2})
    got = believer.believed(top2, above, T0, {5: "w1"})
    assert got is not None and "interval is wider" not in convergence.assess(top2, got).reason
    # The conductor holds a launch back for a believed launch below the best, with or without a
    # confirmation, and for a believed leader when a confirmation will measure it again.
    monkeypatch.setattr(convergence, "assess", settled_once_believed(0.01))
    lease = c.LeaseView("t5", "trial", "active", 5, worker_id="w1")
    for name, trials, top in (("believe-hold-below", below, 0), ("believe-hold-top2", above, 2)):
        spec = spec_of(name, confirmation={"top": top})
        action = c.next_action(snap(spec, trials, baselines=FLEET_BASES, hosts=FLEET, leases=[lease]), "w3")
        assert isinstance(action, c.Wait), name
