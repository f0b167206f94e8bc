"""Time to a confirmed answer: the convergence stop, the OOM boundary, parallel diversity (no database)."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import numpy as np
import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState, create_trial
from scipy.stats import norm

from optimizer import attrs as A
from optimizer import conductor, convergence, costs, launch_cost, ranking, stop_rules
from optimizer import confirmation as confirm
from optimizer import study as opt
from optimizer.infeasible import needs_at_least
from optimizer.memory_boundary import MemoryBoundary, terms_for, tuning_launches
from optimizer.model_sampler import (
    NEAR_COPY,
    OpenPool,
    coords,
    gain_over,
    lattice_distance,
    local_moves,
    observations_of,
    open_pool,
    propose,
    space_configs,
)
from optimizer.perf_model import fit
from optimizer.plan import server_settings
from optimizer.policy import DEFAULT_POLICY
from optimizer.space import SearchSpace, SpecConfig
from optimizer.spec import parse_spec
from optimizer.stop_rules import StopRule
from spectune_sim.landscapes import LANDSCAPES
from spectune_sim.model import true_optimum
from tests.support.api_client import Api
from tests.support.search import drive, trial_attrs
from tests.support.search import frozen_trial as _frozen
from tests.support.specs import small_spec

optuna.logging.set_verbosity(optuna.logging.WARNING)


def spec(**kw: Any) -> Any:
    base: dict[str, Any] = {"name": "c", "model": {"target": "t", "draft": "d"}, "seed": 3, "sampler": "auto"}
    base.update(kw)
    return parse_spec(base)


def attrs_for(landscape: str, config: SpecConfig) -> tuple[float, dict[str, Any]]:
    a = trial_attrs(landscape, config, [1], startup_s=30.0 + 2.0 * config.num_steps)
    return a["speedup_by_level"]["1"], a


def measured(landscape: str, configs: list[SpecConfig]) -> list[FrozenTrial]:
    """These configurations measured on the simulator at concurrency 1, numbered in this order."""
    return [_frozen(i, *attrs_for(landscape, c)) for i, c in enumerate(configs)]


def run_until_settled(landscape: str, max_trials: int) -> tuple[list[convergence.Assessment], float]:
    """The service's loop in memory: ask, measure with the simulator, tell, assess."""
    sp = spec()
    storage = optuna.storages.InMemoryStorage()
    opt.create_study(storage, sp)
    history = []
    best = 0.0
    for _ in range(max_trials):
        study = opt.load_study(storage, sp)
        asked = opt.ask(study, sp)
        value, a = attrs_for(landscape, asked.config)
        opt.tell_value(study, asked.number, value, 0.0, a)
        best = max(best, value)
        history.append(convergence.assess(sp, study.get_trials(deepcopy=False)))
        if history[-1].settled:
            break
    return history, best


def test_a_study_stops_on_convergence_and_says_why() -> None:
    history, best = run_until_settled("moe-pcie", 30)
    last = history[-1]
    assert last.settled, last.reason
    assert len(history) < 30
    assert last.reason.startswith("converged after"), last.reason
    assert "by more than 1%" in last.reason and last.pays is True
    assert last.best_chance < convergence.P_MATTERS
    _, optimum = true_optimum(LANDSCAPES["moe-pcie"], SearchSpace(), 1)
    assert best >= 0.98 * optimum
    # Never before the model has enough to stand on.
    assert all(not h.settled for h in history[: convergence.MIN_MEASURED - 1])


def test_speculation_that_does_not_pay_ends_the_study_early() -> None:
    history, best = run_until_settled("no-gain", 30)
    last = history[-1]
    assert last.settled and last.pays is False, last.reason
    assert best < 1.0
    assert last.reason.startswith("speculation does not pay"), last.reason
    assert len(history) <= 10


def test_an_unfamiliar_landscape_does_not_stop_while_the_model_is_unsure() -> None:
    # zigzag-tiles: acceptance that is not monotone across draft positions and a verify cost that
    # steps at 16-token tiles, neither of which the model's family can express.
    sp = spec()
    trials = measured(
        "zigzag-tiles",
        [
            SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
            SpecConfig(num_steps=5, topk=4, num_draft_tokens=8),
            SpecConfig(num_steps=1, topk=1, num_draft_tokens=2),
            SpecConfig(num_steps=2, topk=1, num_draft_tokens=3),
        ],
    )
    a4 = convergence.assess(sp, trials)
    assert not a4.settled, a4.reason
    # Its own uncertainty about what it has not seen (deeper trees) keeps the study going.
    assert a4.best_chance >= 0.5, a4
    assert a4.best_chance_config not in {t.user_attrs["config_key"] for t in trials}
    # And with fewer than MIN_MEASURED it never judges at all.
    few = convergence.MIN_MEASURED - 1
    assert f"only {few} configurations" in convergence.assess(sp, trials[:few]).reason


def test_a_probable_oom_is_skipped_not_only_what_dominates_a_failure() -> None:
    """The issue's walk down 4/8/33 -> 4/8/32 -> ... -> 3/8/21, one OOM launch each, does not happen."""
    sp = spec(workload={"concurrency": [16]})
    trials = measured(
        "dense-8b-h100",
        [
            SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
            SpecConfig(num_steps=5, topk=4, num_draft_tokens=8),
            SpecConfig(num_steps=2, topk=2, num_draft_tokens=3),
        ],
    )
    failed = SpecConfig(num_steps=4, topk=8, num_draft_tokens=33)
    oom_attrs = {"config": failed.model_dump(mode="json"), "config_key": failed.key, "failure_kind": "oom"}
    trials.append(_frozen(3, 0.5, oom_attrs, violation=10.0))
    probable = [
        SpecConfig(num_steps=4, topk=8, num_draft_tokens=32),
        SpecConfig(num_steps=3, topk=8, num_draft_tokens=25),
    ]
    for c in probable:
        assert not needs_at_least(c, failed)  # the old dominance rule would launch them
    boundary = MemoryBoundary.fit(tuning_launches(sp, trials))
    assert boundary is not None
    configs = [*probable, SpecConfig(num_steps=2, topk=2, num_draft_tokens=3)]
    p = boundary.p_fail(terms_for(lambda c: server_settings(sp, c), configs))
    assert p[0] >= DEFAULT_POLICY.probable_failure and p[1] >= DEFAULT_POLICY.probable_failure, p
    assert p[2] == 0.0  # inside what started
    pool = {c.key for c in open_pool(sp, trials).configs}
    assert not pool & {c.key for c in probable}
    # The bar is the study's policy (the snapshot's): a study that launches whatever is not sure
    # to fail keeps them open.
    bold = dataclasses.replace(DEFAULT_POLICY, probable_failure=1.0)
    assert {c.key for c in probable} <= {c.key for c in open_pool(sp, trials, bold).configs}
    proposal = propose(sp, trials, random.Random(0))
    assert proposal is not None and proposal.p_fail < DEFAULT_POLICY.probable_failure


def test_parallel_proposals_differ_and_are_never_near_copies() -> None:
    sp = spec()
    trials = measured(
        "dense-8b-h100",
        [
            SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
            SpecConfig(num_steps=5, topk=4, num_draft_tokens=8),
            SpecConfig(num_steps=7, topk=8, num_draft_tokens=50),
        ],
    )
    rng = random.Random(0)
    first = propose(sp, trials, rng)
    assert first is not None
    # The first is now in flight on another worker.
    running = create_trial(
        state=TrialState.RUNNING,
        params={},
        distributions={},
        user_attrs={"config": first.config.model_dump(mode="json"), "config_key": first.config.key},
    )
    running.number = len(trials)
    second = propose(sp, [*trials, running], rng)
    assert second is not None
    assert second.config.key != first.config.key
    gap = math.dist(coords([first.config])[0], coords([second.config])[0])
    assert gap >= NEAR_COPY, (first.config.key, second.config.key)


def test_the_service_finishes_a_converged_study_and_says_why(api: Api) -> None:
    spec = small_spec("conv", sampler="auto", budget={"max_trials": 20})
    spec["confirmation"] = {"top": 2}
    assert api.post("/v1/studies", "user", spec).status_code == 201
    handed = drive(api, "conv", ["w1", "w2"], "moe-pcie")
    shown = api.get("/v1/studies/conv", "user").json()
    assert shown["state"] == "finished"
    launched = [le for le in handed if le["kind"] == "trial"]
    assert len(launched) < 20 and shown["configurations_launched"] == len(launched)
    assert shown["finish_reason"].startswith("converged after"), shown["finish_reason"]
    assert "confirmed" in shown["finish_reason"]
    # Confirmation followed the stop: the winner is confirmed against a fresh baseline.
    assert shown["winner"]["confirmed"] is True
    assert shown["verdict"].startswith("speculation pays")
    # Cost is part of the answer: every launch counted by kind, next to SGLang's grid.
    cost = shown["cost"]
    by_kind = cost["launches_by_kind"]
    assert by_kind == {
        "baselines": sum(1 for le in handed if le["kind"] == "baseline"),
        "search": len(launched),
        "confirmation": sum(1 for le in handed if le["kind"] == "confirm"),
        "failed": 0,
    }
    assert cost["launches"] == len(handed)
    assert cost["bench_speculative_grid"]["launches"] == 48
    assert cost["gpu_hours"] == pytest.approx(sum(cost["gpu_hours_by_kind"].values()))
    assert f"{len(handed)} launches" in cost["summary"] and "bench_speculative grid: 48 launches" in cost["summary"]


def test_a_converging_study_can_be_switched_off(api: Api) -> None:
    spec = small_spec("noconv", sampler="auto", budget={"max_trials": 6, "converge": False})
    spec["confirmation"] = {"top": 0}
    assert api.post("/v1/studies", "user", spec).status_code == 201
    drive(api, "noconv", ["w1"], "moe-pcie")
    shown = api.get("/v1/studies/noconv", "user").json()
    assert shown["configurations_launched"] == 6
    assert "max_trials=6" in shown["finish_reason"]


def test_cost_counts_failed_launches_apart_and_prices_the_grid_at_the_median_launch() -> None:
    launches = [
        costs.Launch("baselines", 600.0, 8),
        costs.Launch("search", 900.0, 8),
        costs.Launch("search", 1200.0, 8),
        costs.Launch("failed", 800.0, 8),
        costs.Launch("confirmation", 900.0, 8),
    ]
    c = costs.tally(launches)
    assert c.launches == {"baselines": 1, "search": 2, "confirmation": 1, "failed": 1}
    assert c.gpu_hours["failed"] == pytest.approx(800 * 8 / 3600)
    assert c.total_gpu_hours == pytest.approx(4400 * 8 / 3600)
    # 47 valid points of bench_speculative's grid, and one baseline.
    assert len(costs.grid_points()) == 47 and c.grid_launches == 48
    assert c.median_launch_gpu_hours == pytest.approx(900 * 8 / 3600)
    assert c.grid_gpu_hours == pytest.approx(48 * 900 * 8 / 3600)
    assert c.summary().startswith("5 launches, 9.78 GPU-hours (1 baseline, 2 search, 1 confirmation, 1 failed)")


def test_launch_cost_is_fitted_from_measured_start_ups() -> None:
    """Graph capture grows with the draft steps: the fit sees it in the start-ups measured."""
    sp = spec()
    trials = []
    for i, c in enumerate(
        [
            SpecConfig(num_steps=1, topk=1, num_draft_tokens=2),
            SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
            SpecConfig(num_steps=5, topk=4, num_draft_tokens=8),
            SpecConfig(num_steps=7, topk=2, num_draft_tokens=12),
        ]
    ):
        value, a = attrs_for("dense-8b-h100", c)
        a["startup_s"] = 300.0 + 40.0 * c.num_steps
        trials.append(_frozen(i, value, a))
    cost = launch_cost.fit(sp, trials)
    shallow, deep = (
        SpecConfig(num_steps=2, topk=1, num_draft_tokens=3),
        SpecConfig(num_steps=9, topk=1, num_draft_tokens=10),
    )
    s_shallow, s_deep = cost.startup_s([shallow, deep])
    assert s_shallow == pytest.approx(380.0, rel=0.1) and s_deep == pytest.approx(660.0, rel=0.15)
    # The benchmark time comes from the baseline's rate and the predicted speedup; a failed
    # launch costs its start-up only.
    full, failing = cost.seconds([shallow, shallow], np.array([2.0, 2.0]), np.array([0.0, 1.0]))
    assert failing == pytest.approx(s_shallow) and full > failing


# --- Stop rules that do not depend on the model's form (optimizer.stop_rules) -----------------

ZIGZAG_RUN = [
    SpecConfig(num_steps=6, topk=4, num_draft_tokens=16),  # the optimum, launched first
    SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
    SpecConfig(num_steps=5, topk=4, num_draft_tokens=8),
    SpecConfig(num_steps=2, topk=1, num_draft_tokens=3),
    SpecConfig(num_steps=7, topk=8, num_draft_tokens=40),
]


def _run_with_predictions(
    configs: list[SpecConfig], miss: float, hosts: int = 2, move: str = "local"
) -> list[FrozenTrial]:
    """zigzag-tiles results in launch order; each after the first carries the prediction the
    sampler made before launching it: the measured value x `miss`, claiming a 2% log-sd, and the
    sampler's move (its local walk around the incumbent, unless told otherwise)."""
    trials = []
    for i, c in enumerate(configs):
        value, a = attrs_for("zigzag-tiles", c)
        a["worker_id"] = f"w{i % hosts}"
        if i > 0:
            a["model_prediction"] = {"speedup": value * miss, "log_sd": 0.02, "move": move}
        trials.append(_frozen(i, value, a))
    return trials


def test_a_model_that_mispredicts_is_distrusted_and_the_empirical_rule_stops_the_study() -> None:
    trials = _run_with_predictions(ZIGZAG_RUN, miss=1.25)
    check = stop_rules.prediction_check(trials)
    assert not check.trusted and check.checked == 4 and check.rms_miss > 5, check
    a = convergence.assess(spec(), trials)
    assert a.settled and a.rule is StopRule.EMPIRICAL and a.pays is True, a.reason
    assert a.reason.startswith("converged after 5 configurations (empirical rule)"), a.reason
    assert "not trusted" in a.reason and "none of the last 4 launches beat s6-k4-n16" in a.reason, a.reason
    assert stop_rules.hold_needed(1) <= 4
    assert a.as_json()["rule"] == "empirical" and a.as_json()["model_trusted"] is False


def test_the_empirical_rule_waits_while_the_incumbent_is_new() -> None:
    # The best launched third: two launches after it are fewer than the rule wants.
    order = [ZIGZAG_RUN[1], ZIGZAG_RUN[2], ZIGZAG_RUN[0], ZIGZAG_RUN[3], ZIGZAG_RUN[4]]
    trials = _run_with_predictions(order, miss=1.25)
    need = stop_rules.hold_needed(3)
    assert need > 2
    b = convergence.assess(spec(), trials)
    assert not b.settled and b.rule is None, b.reason
    assert f"empirical rule waits for {need} launches" in b.reason and "(2 so far)" in b.reason, b.reason
    # One more quiet launch than that, and it stops.
    more = _run_with_predictions([*order, SpecConfig(num_steps=1, topk=1, num_draft_tokens=2)], miss=1.25)
    assert convergence.assess(spec(), more).rule is StopRule.EMPIRICAL


def test_a_distrusted_models_own_proposals_are_not_the_empirical_rules_evidence() -> None:
    # The same results, but proposed by the model (wrong here), not walked around the incumbent.
    trials = _run_with_predictions(ZIGZAG_RUN, miss=1.25, move="model")
    a = convergence.assess(spec(), trials)
    assert not a.model_trusted and not a.settled and a.quiet == 0 and a.walking, a.reason
    assert "empirical rule waits for 3 launches around s6-k4-n16" in a.reason and "(0 so far)" in a.reason, a.reason
    # Two of its neighbours launched without a gain, then a third: the walk stops it.
    around = [
        SpecConfig(num_steps=5, topk=4, num_draft_tokens=16),
        SpecConfig(num_steps=7, topk=4, num_draft_tokens=16),
    ]
    walked = trials + [_run_with_predictions([*ZIGZAG_RUN, c], miss=1.25)[-1] for c in around]
    for i, t in enumerate(walked):
        t.number = i
    b = convergence.assess(spec(), walked)
    assert not b.settled and b.quiet == 2, b.reason
    third = _run_with_predictions([*ZIGZAG_RUN, SpecConfig(num_steps=6, topk=4, num_draft_tokens=15)], miss=1.25)[-1]
    third.number = len(walked)
    c = convergence.assess(spec(), [*walked, third])
    assert c.settled and c.rule is StopRule.EMPIRICAL and c.quiet == 3, c.reason
    assert "none of the last 7 launches beat s6-k4-n16" in c.reason and "3 of them its neighbours" in c.reason, c.reason


def test_without_a_model_to_walk_by_the_empirical_rule_counts_every_launch() -> None:
    # An engine that reports no accept length: no model, so no walk; the rule must not wait for one.
    trials = _run_with_predictions(ZIGZAG_RUN, miss=1.25, move="model")
    for t in trials:
        for lv in t.user_attrs[A.LEVELS]:
            lv.pop("accept_length", None)
    a = convergence.assess(spec(), trials)
    assert a.settled and a.rule is StopRule.EMPIRICAL and not a.walking and a.quiet == 4, a.reason


def test_a_walk_around_an_earlier_incumbent_is_not_the_new_ones() -> None:
    trials = _run_with_predictions(ZIGZAG_RUN, miss=1.25)  # the optimum first, then four walks
    history = stop_rules.launches(trials)
    lead = stop_rules.lead(history, 0.01)
    assert stop_rules.walked_since(trials, history, lead) == 4
    best = ZIGZAG_RUN[0].canonical().key
    for t in trials[1:]:
        t.user_attrs["model_prediction"]["around"] = best
    assert stop_rules.walked_since(trials, history, lead) == 4
    trials[-1].user_attrs["model_prediction"]["around"] = ZIGZAG_RUN[2].canonical().key
    assert stop_rules.walked_since(trials, history, lead) == 3
    # In flight: only a walk around the incumbent adds to the spell.
    flying = _run_with_predictions([*ZIGZAG_RUN, _c(5, 4, 16), _c(7, 4, 16)], miss=1.25)[-2:]
    for t, centre in zip(flying, (best, ZIGZAG_RUN[2].canonical().key), strict=True):
        t.state = TrialState.RUNNING
        t.user_attrs["model_prediction"]["around"] = centre
    assert stop_rules.walks_in_flight([*trials, *flying], lead) == 1


def test_with_no_neighbour_left_every_launch_is_part_of_the_quiet_spell() -> None:
    trials = _run_with_predictions(ZIGZAG_RUN, miss=1.25, move="model")
    history = stop_rules.launches(trials)
    lead = stop_rules.lead(history, 0.01)
    best = A.TrialRecord(trials[0])
    nothing = OpenPool([], np.zeros(0), [])
    assert convergence.quiet_spell(spec(), trials, history, lead, best, nothing) == (lead.since, False)
    assert convergence.quiet_spell(spec(), trials, history, lead, best, open_pool(spec(), trials)) == (0, True)


def test_a_model_that_predicts_within_its_uncertainty_is_not_overruled() -> None:
    trials = _run_with_predictions(ZIGZAG_RUN, miss=1.0)
    check = stop_rules.prediction_check(trials)
    assert check.trusted and check.rms_miss < 1.0, check
    a = convergence.assess(spec(), trials)
    assert a.rule is not StopRule.EMPIRICAL and a.model_trusted, a.reason


def test_a_later_gain_below_min_gain_does_not_restart_the_quiet_spell() -> None:
    def launch(i: int, v: float) -> stop_rules.Launch:
        return stop_rules.Launch(i, f"c{i}", v, None)

    history = [launch(0, 1.5), launch(1, 1.6), launch(2, 1.605), launch(3, 0.0), launch(4, 1.2)]
    lead = stop_rules.lead(history, 0.01)
    assert (lead.found_at, lead.since, lead.best_since) == (2, 3, 1.605)
    # The incumbent the walk goes around is the best launch, c2, not c1 where the count started.
    assert lead.incumbent == "c2"
    # Nothing above the baseline: the baseline is the incumbent, found at launch 0.
    assert stop_rules.lead([launch(0, 0.9), launch(1, 1.005)], 0.01).found_at == 0
    # A climb in steps each within the margin restarts the spell once it adds up to more (two-peaks,
    # seed 17: 2.113 -> 2.134 -> 2.162 -> 2.208 was read as eight launches without a gain).
    climb = [launch(0, 1.5), launch(1, 1.52), launch(2, 1.54), launch(3, 1.56), launch(4, 1.58), launch(5, 1.59)]
    assert (stop_rules.lead(climb, 0.01).found_at, stop_rules.lead(climb, 0.01).since) == (5, 1)
    # A late find needs a longer quiet spell; the backstop is longer still.
    assert stop_rules.hold_needed(2) == stop_rules.HOLD_MIN and stop_rules.hold_needed(12) == 6
    assert stop_rules.stall_needed(12) == 12 > stop_rules.hold_needed(12)


def test_host_offsets_are_noise_the_misfit_expects() -> None:
    # Four hosts, each 2% off in its own direction, and a model that is right otherwise.
    rng = np.random.default_rng(0)
    hosts = [f"w{i % 4}" for i in range(16)]
    offset = {"w0": 0.02, "w1": -0.02, "w2": 0.015, "w3": -0.015}
    resid = np.array([offset[h] for h in hosts]) + rng.normal(0, 0.005, 16)
    sd = np.full(16, 0.01)
    assert convergence.host_misfit(resid, sd, hosts) < 1.3
    # Unlabelled, the same residuals read as a model 1.5x worse than it says.
    assert convergence.host_misfit(resid, sd, [None] * 16) > 1.5


def test_the_improvement_rate_rule_stops_a_model_that_keeps_seeing_a_chance() -> None:
    # The model predicts well (trusted) yet keeps seeing a >= 10% chance somewhere; after
    # stall_needed(1) = 8 launches without a gain over the first one, the backstop ends the study.
    extra = [
        SpecConfig(num_steps=1, topk=1, num_draft_tokens=2),
        SpecConfig(num_steps=2, topk=2, num_draft_tokens=3),
        SpecConfig(num_steps=4, topk=1, num_draft_tokens=5),
        SpecConfig(num_steps=3, topk=4, num_draft_tokens=6),
    ]
    run = ZIGZAG_RUN + extra
    assert stop_rules.stall_needed(1) == 8 == len(run) - 1
    # The model rule asking of the configurations' values (`answer_moves` off): a model that keeps
    # a chance open.  Asking what one launch can show, it settles these launches itself
    # (tests/optimizer/test_answer_moves.py).
    keeps = dataclasses.replace(DEFAULT_POLICY, answer_moves=False)
    before = convergence.assess(spec(), _run_with_predictions(run[:-1], miss=1.0), keeps)
    assert not before.settled and before.model_trusted and before.best_chance >= convergence.P_MATTERS, before.reason
    a = convergence.assess(spec(), _run_with_predictions(run, miss=1.0), keeps)
    assert a.settled and a.rule is StopRule.IMPROVEMENT_RATE and a.model_trusted, a.reason
    assert a.reason.startswith("converged after 9 configurations (improvement-rate rule)"), a.reason
    assert "none of the last 8 launches beat s6-k4-n16" in a.reason and "found at launch 1" in a.reason


# --- Model-free local moves once the model is distrusted (optimizer.model_sampler) -------------


def _c(steps: int, topk: int, tokens: int) -> SpecConfig:
    return SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=tokens).canonical()


def test_the_lattice_neighbours_are_one_flag_step_away() -> None:
    space = SearchSpace()
    ref = _c(5, 4, 14)
    got = lattice_distance(
        ref, [_c(5, 4, 15), _c(6, 4, 14), _c(5, 8, 14), _c(5, 2, 14), _c(5, 4, 16), _c(6, 8, 14)], space
    )
    assert got.tolist() == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0]
    # A chain's draft tokens follow its steps: the next chain is one step away.
    assert lattice_distance(_c(3, 1, 4), [_c(4, 1, 5)], space).tolist() == [1.0]
    # Draft-token steps grow with the tree: 43 tokens move by 4 at a time.
    assert lattice_distance(_c(6, 8, 43), [_c(6, 8, 47)], space).tolist() == [1.0]
    pool = [c for c in space_configs(space) if c.key != ref.key]
    ring = local_moves(ref, pool, space)
    keys = sorted(pool[i].key for i in ring.index)
    assert keys == sorted(
        c.key for c in [_c(4, 4, 14), _c(6, 4, 14), _c(5, 2, 14), _c(5, 8, 14), _c(5, 4, 13), _c(5, 4, 15)]
    )
    # Once the whole first ring is launched, the second one.
    rest = [c for c in pool if c.key not in keys]
    second = local_moves(ref, rest, space)
    assert second.index.size and all(lattice_distance(ref, [rest[i]], space)[0] == 2.0 for i in second.index)


def test_local_moves_go_onward_where_the_incumbent_beat_the_step_the_other_way() -> None:
    space = SearchSpace()
    ref = _c(5, 4, 14)
    measured = [_c(5, 4, 13), ref, _c(5, 8, 14), _c(9, 8, 64)]  # 13 tokens and topk 8 were worse
    pool = [c for c in space_configs(space) if c.key not in {x.key for x in measured}]
    moves = local_moves(ref, pool, space, measured)
    ring = [pool[i] for i in moves.index]
    onward = sorted(c.key for c, o in zip(ring, moves.onward, strict=True) if o)
    assert onward == sorted([_c(5, 4, 15).key, _c(5, 2, 14).key])
    assert len(ring) == 4  # 4/4/14, 6/4/14, 5/2/14, 5/4/15
    # Chains mirror along their steps.
    chain = _c(4, 1, 5)
    pool = [c for c in space_configs(space) if c.key not in {chain.key, _c(3, 1, 4).key}]
    moves = local_moves(chain, pool, space, [_c(3, 1, 4), chain])
    assert [pool[i].key for i, o in zip(moves.index, moves.onward, strict=True) if o] == [_c(5, 1, 6).key]


def test_a_distrusted_model_walks_the_incumbents_neighbours_instead_of_its_argmax() -> None:
    space = SearchSpace()
    trials = _run_with_predictions(ZIGZAG_RUN, miss=1.25)
    assert not stop_rules.prediction_check(trials).trusted
    p = propose(spec(), trials, random.Random(0))
    assert p is not None and p.move == "local" and p.around == ZIGZAG_RUN[0].canonical().key
    assert lattice_distance(ZIGZAG_RUN[0], [p.config], space)[0] == 1.0, p.config.key
    # The model still says what it expects there (the prediction check goes on).
    assert p.predicted_speedup > 0 and p.predicted_sd > 0
    # A model that predicts within its uncertainty proposes its own best, wherever it lies.
    trusted = propose(spec(), _run_with_predictions(ZIGZAG_RUN, miss=1.0), random.Random(0))
    assert trusted is not None and trusted.move == "model"


def _c(steps: int, topk: int, tokens: int) -> SpecConfig:
    return SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=tokens)


def test_the_depth_probe_is_one_draft_step_past_an_incumbent_that_is_the_deepest_launch() -> None:
    pool = list(space_configs(SearchSpace()))
    inc = _c(5, 4, 16)
    launched = measured("two-peaks", [_c(3, 1, 4), _c(5, 4, 8), _c(4, 4, 13), inc])
    probe = stop_rules.depth_probe(launched, inc, pool, 8)
    # Same tree width, one more step, draft tokens in proportion.
    assert probe is not None and probe.key == _c(6, 4, 19).key
    # A deeper launch of any shape, or an incumbent at the space's depth: nothing to probe.
    deeper = measured("two-peaks", [_c(3, 1, 4), _c(5, 4, 8), _c(4, 4, 13), inc, _c(6, 2, 7)])
    assert stop_rules.depth_probe(deeper, inc, pool, 8) is None
    assert stop_rules.depth_probe(launched, _c(8, 4, 25), pool, 8) is None
    assert stop_rules.depth_probe(launched, inc, [c for c in pool if c.num_steps != 6], 8) is None


def test_the_model_rule_waits_for_a_launch_past_the_deepest_incumbent() -> None:
    """two-peaks seed 7 (benchmarks/search_efficiency.py): nine launches no deeper than 5 steps,
    a model that sees nothing left to beat s5-k4-n16 (2.6% below the optimum, s8-k4-n25).  The
    rule waits, the sampler launches one step deeper, and the walk goes on while deeper wins."""
    configs = [_c(3, 1, 4), _c(5, 4, 8), _c(5, 8, 64), _c(4, 4, 32), _c(4, 8, 13), _c(5, 4, 16), _c(5, 2, 6),
               _c(4, 2, 6), _c(4, 4, 13)]  # fmt: skip
    sp = spec()
    trials = measured("two-peaks", configs)
    a = convergence.assess(sp, trials)
    assert not a.settled, a.reason
    p = propose(sp, trials, random.Random(0))
    assert p is not None and p.config.num_steps == 6
    if a.best_chance < convergence.P_MATTERS:
        # The model sees nothing left: the depth probe waits for and proposes the launch past it.
        assert "deepest launch" in a.reason and "s6-k4-n19" in a.reason
        assert p.move == "probe" and p.config.key == _c(6, 4, 19).key
        # Deeper won (2.224x against 2.186x): the next probe is one step further.
        deeper = convergence.assess(sp, measured("two-peaks", [*configs, p.config]))
        assert not deeper.settled and "s7-k4-n22" in deeper.reason
    else:
        # The model's misfit (optimizer.residual_gp) leaves a deeper configuration a chance that
        # matters: the model itself keeps the study going and proposes one step deeper.
        assert a.best_chance_config is not None and "s6-" in a.best_chance_config, a.reason
    # A deeper launch that loses brackets the incumbent: the model rule may settle again.
    lost = measured("two-peaks", [*configs, _c(6, 2, 7)])
    assert "deepest launch" not in convergence.assess(sp, lost).reason


def test_the_conductors_assessment_sees_a_launch_go_out() -> None:
    """The conductor's memo of the assessment is keyed on the launches in flight too: one asked
    since the last result is no longer an open configuration (the study document named it as the
    one most likely to win, and the fleet's gating counted it as still to launch)."""
    sp = spec()
    configs = [
        SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
        SpecConfig(num_steps=5, topk=4, num_draft_tokens=8),
        SpecConfig(num_steps=1, topk=1, num_draft_tokens=2),
        SpecConfig(num_steps=2, topk=1, num_draft_tokens=3),
    ]
    trials = measured("zigzag-tiles", configs)
    before = conductor.stop_rule(sp, trials)
    assert before.best_chance_config is not None
    top = next(c for c in space_configs(sp.search_space) if c.key == before.best_chance_config)
    flying = create_trial(
        state=TrialState.RUNNING,
        user_attrs={A.CONFIG: top.model_dump(mode="json"), A.CONFIG_KEY: top.key},
    )
    flying.number = len(trials)
    after = conductor.stop_rule(sp, [*trials, flying])
    assert after.open_configs == before.open_configs - 1
    assert after.best_chance_config != top.key


def _lucky(trials: list[FrozenTrial], i: int, factor: float) -> list[FrozenTrial]:
    """`trials` with launch i measured `factor` faster than the engine runs it (a lucky draw)."""
    t = trials[i]
    a = dict(t.user_attrs)
    a["levels"] = [{**lv, "output_tok_s": lv["output_tok_s"] * factor} for lv in a["levels"]]
    a["speedup_by_level"] = {k: v * factor for k, v in a["speedup_by_level"].items()}
    return [*trials[:i], _frozen(t.number, float(t.value or 0.0) * factor, a), *trials[i + 1 :]]


def _predicted(landscape: str, configs: list[tuple[int, int, int]]) -> list[FrozenTrial]:
    """These configurations measured on the simulator, each after the first predicted exactly
    (a model whose predictions held: it ranks the candidates)."""
    trials = []
    for i, (s, k, n) in enumerate(configs):
        value, a = attrs_for(landscape, SpecConfig(num_steps=s, topk=k, num_draft_tokens=n))
        if i > 0:
            a["model_prediction"] = {"speedup": value, "log_sd": 0.02, "move": "model"}
        trials.append(_frozen(i, value, a))
    return trials


# noisy-8b, four workers, seed 9 (benchmarks/search_efficiency.py): its first ten launches.
NOISY_SEED_9 = [(5, 4, 8), (4, 4, 16), (7, 8, 50), (6, 4, 19), (7, 8, 64), (6, 8, 26), (6, 8, 33), (6, 4, 20),
                (7, 8, 51), (6, 8, 42)]  # fmt: skip


def test_a_lucky_launch_is_not_the_bar_where_the_model_ranks_the_answer() -> None:
    """noisy-8b with four workers, seed 9: s6-k4-n20 drew 3% above what the engine gives, led by
    measurement, and the model rule never settled against it (the model kept a 25-44% chance
    that s6-k8-n41 beats it by 1%, and ranked s6-k8-n42, launched, above it); the study ran 20
    search launches to the improvement-rate rule.  The same launches on dense-8b-h100 (noisy-8b's
    engine), with s6-k4-n20 drawn 3% high: the bar is the confirmed candidate the model ranks
    first, for the stop rule and the sampler alike (ranking.answer_bar)."""
    sp = spec()
    trials = _predicted("dense-8b-h100", NOISY_SEED_9)
    fair = trials[7]
    trials = _lucky(trials, 7, 1.03)
    lucky = trials[7]
    rank = ranking.of(sp, trials)
    assert rank is not None
    bar = ranking.answer_bar(sp, trials, rank)
    assert bar is not None and bar.user_attrs["config_key"] == "s6-k8-n42-bsauto"
    lucky_cfg, bar_cfg = A.TrialRecord(lucky).config, A.TrialRecord(bar).config
    assert rank.estimate(bar_cfg) > rank.estimate(lucky_cfg)
    # It is one the confirmation re-measures, and the model's first among them.
    chosen = confirm.candidates(trials, sp.confirmation.top, sp, 0.0, rank)
    assert bar in chosen and all(rank.estimate(A.TrialRecord(t).config) <= rank.estimate(bar_cfg) for t in chosen)
    # Against it, what is left has less chance than against the lucky launch's own fit.
    model = fit(observations_of(trials), sp.search_space.num_steps.high)
    assert model is not None
    op = open_pool(sp, trials)
    v = float(lucky.value or 0.0)
    # As the rule asks it: what one launch can move the answer by (optimizer.gains.moved_sd).
    noise = stop_rules.launch_variance(trials)
    plain, _ = convergence._model_chance(
        sp, model, trials, trials, v, lucky_cfg, op, 0.01, DEFAULT_POLICY.model_floor, launch_var=noise
    )
    ranked, _ = convergence._model_chance(
        sp, model, trials, trials, v, bar_cfg, op, 0.01, DEFAULT_POLICY.model_floor, launch_var=noise
    )
    assert ranked is not None and plain is not None and ranked.rate < plain.rate
    now = convergence.assess(sp, trials)
    assert not now.settled and "s6-k8-n42-bsauto (the model's first)" in now.reason, now.reason
    assert now.best_chance == pytest.approx(ranked.rate, rel=0.05)
    # Without the lucky draw the leader is s6-k8-n42 by measurement too: the same bar.
    fair_bar = ranking.answer_bar(sp, [*trials[:7], fair, *trials[8:]], rank)
    assert fair_bar is not None and fair_bar.user_attrs["config_key"] == "s6-k8-n42-bsauto"
    # A study that confirms only one candidate confirms the model's first, not the luckiest launch.
    one = spec(confirmation={"top": 1})
    assert ranking.answer_bar(one, trials, rank) is bar
    # The believer (optimizer.believer) asks what the rule would say if a launch came in as
    # believed: a believed launch is the bar the real one would be.
    believed = [*trials[:9], _frozen(9, float(trials[9].value or 0.0), {**trials[9].user_attrs, A.BELIEVED: True})]
    assert ranking.answer_bar(sp, believed, rank) is believed[9]


def test_the_models_first_leads_the_candidates_and_lucky_launches_take_no_place() -> None:
    """With `confirmation.top` 2, two lucky launches lead by measurement: s7-k8-n50 and s7-k8-n64,
    which the model ranks far below.  s6-k8-n42, third by measurement, is the model's first: it
    leads the candidates and is the bar, and neither lucky launch (no chance to beat it by
    min_gain) takes the second place: s6-k4-n19, which has that chance, does."""
    sp = spec(confirmation={"top": 2})
    trials = _lucky(_lucky(_predicted("dense-8b-h100", NOISY_SEED_9), 2, 1.03), 4, 1.04)
    by_value = [t.user_attrs["config_key"] for t in sorted(trials, key=lambda t: -float(t.value or 0.0))]
    assert by_value[:3] == ["s7-k8-n50-bsauto", "s7-k8-n64-bsauto", "s6-k8-n42-bsauto"]
    rank = ranking.of(sp, trials)
    assert rank is not None
    chosen = [t.user_attrs["config_key"] for t in confirm.candidates(trials, 2, sp, 0.0, rank)]
    assert chosen == ["s6-k8-n42-bsauto", "s6-k4-n19-bsauto"]
    bar = ranking.answer_bar(sp, trials, rank)
    assert bar is not None and bar.user_attrs["config_key"] == "s6-k8-n42-bsauto"


def test_the_depth_probe_looks_past_the_bar() -> None:
    """two-peaks, nine launches no deeper than 5 steps, s4-k4-n13 3% lucky: it leads by
    measurement, the model ranks s5-k4-n16 first, and that is the deepest launch.  The rule waits
    for one launch a step past the bar, and the sampler proposes it (past the leader there would
    be nothing to probe: 5-step launches exist)."""
    base = [(3, 1, 4), (5, 4, 8), (5, 8, 64), (4, 4, 32), (4, 8, 13), (5, 4, 16), (5, 2, 6), (4, 2, 6), (4, 4, 13)]
    sp = spec()
    trials = _lucky(_predicted("two-peaks", base), 8, 1.03)
    assert max(trials, key=lambda t: float(t.value or 0.0)).user_attrs["config_key"] == "s4-k4-n13-bsauto"
    a = convergence.assess(sp, trials)
    assert not a.settled, a.reason
    p = propose(sp, trials, random.Random(0))
    assert p is not None and p.config.num_steps == 6
    if a.best_chance < convergence.P_MATTERS:
        assert "s5-k4-n16-bsauto is the deepest launch" in a.reason and "(s6-k4-n19-bsauto)" in a.reason, a.reason
        assert "the model ranks it above s4-k4-n13-bsauto" in a.reason, a.reason
        assert p.move == "probe" and p.config.key == "s6-k4-n19-bsauto"
    else:
        # The model's misfit (optimizer.residual_gp) leaves a deeper configuration a chance that
        # matters: the model itself keeps the study going, one step past the bar.
        assert a.best_chance_config is not None and "s6-" in a.best_chance_config, a.reason


def test_the_sampler_aims_at_the_bar_the_rule_weighs_against() -> None:
    """The sampler asks the stop rule's question (how much may each candidate beat the bar by
    more than min_gain): with a lucky leader, its expected improvement is over the model's first
    (ranking.answer_bar), not over the leader."""
    sp = spec()
    trials = _lucky(_predicted("dense-8b-h100", NOISY_SEED_9), 7, 1.03)
    rank = ranking.of(sp, trials)
    assert rank is not None
    bar = ranking.answer_bar(sp, trials, rank)
    assert bar is not None and bar is not trials[7]
    model = fit(observations_of(trials), sp.search_space.num_steps.high)
    assert model is not None
    got = propose(sp, trials, random.Random(0), model)
    assert got is not None and got.move == "model"

    def ei_over(ref: SpecConfig) -> float:
        diff, sd = gain_over(sp, model, [got.config], ref)
        z = (float(diff[0]) - math.log1p(sp.budget.min_gain)) / float(sd[0])
        return float(sd[0]) * (z * norm.cdf(z) + norm.pdf(z))

    over_bar, over_lucky = ei_over(A.TrialRecord(bar).config), ei_over(A.TrialRecord(trials[7]).config)
    # (Not smaller everywhere: the model's floor grows with the distance to the bar.)
    assert over_bar != pytest.approx(over_lucky, rel=0.05)
    assert got.expected_improvement == pytest.approx(over_bar, rel=1e-6)
