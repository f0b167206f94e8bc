"""The `auto` sampler: choose the next configuration with the fitted performance model.

Each ask fits `optimizer.perf_model` to every measured trial (accept length and cycle time per
level, not only the speedup), scores every valid configuration of the space that was never
launched, is not in flight and is not known or likely to run out of memory (optimizer.infeasible,
optimizer.deployability), and proposes the one with the largest expected improvement (in log
speedup) over the best measurement so far per second of predicted launch and benchmark time
(optimizer.launch_cost), discounted by its risk of failing to start or to deploy.  The model's
uncertainty (Laplace) makes it try informative configurations while the fit is loose, and go
straight for the predicted optimum once it is tight.

Before any trial carries an accept length (warm starts still running, or an engine that does
not report one) it falls back to published configurations while nothing has finished
(`blind_start`: a fleet's workers asking before any result), then to TPE; enqueued warm starts
always win (Optuna's fixed params).  Configurations in flight are excluded, their near-copies
too, and the value of their neighbours is discounted, so parallel workers get different,
informative proposals.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState
from scipy.stats import norm

from optimizer import attrs as A
from optimizer import decide, deployability, ranking, stop_rules
from optimizer.gains import beat_z
from optimizer.gains import coords as coords
from optimizer.gains import gain_over as gain_over
from optimizer.gains import objective_levels as objective_levels
from optimizer.gains import observations_of as observations_of
from optimizer.infeasible import known_to_fail, oom_points
from optimizer.params import distributions
from optimizer.perf_model import (
    Candidates,
    FittedModel,
    FloatArray,
    fit,
)
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.space import SearchSpace, SpecConfig, params_of, published_starts, with_largest_graph
from optimizer.spec import StudySpec
from optimizer.verify_probe import VerifyShape

log = logging.getLogger(__name__)

# Above this many valid configurations, score a random subset each ask (plus the neighbours of
# the best measured one); the default space has ~750.
MAX_SCORED = 20_000
PREDICTION_ATTR = A.MODEL_PREDICTION
# Two configurations closer than this (optimizer.model_sampler.coords) are near-copies: never
# both in flight.
NEAR_COPY = DEFAULT_POLICY.near_copy  # optimizer.policy


# The acquisition's one rule on early launches (issue 31, "Must show": no proposal among the first
# four predicted by the model before it runs to lose to the best configuration measured so far by
# more than 20%): a configuration whose predicted speedup is below (1 - LOSE_BY) x the best
# measured (the baseline's 1.0x when nothing beats it) is not proposed while any other is open.
# An exception (nothing else open, or a move whose purpose is to resolve a part of the model: the
# depth probe, the walk around the incumbent once the model failed its check) is proposed with its
# purpose stored on the trial (attrs.PROPOSAL_PURPOSE).  The 20% is the issue's.
LOSE_BY = DEFAULT_POLICY.lose_by  # optimizer.policy


# How far the model-free local moves look around the incumbent (in `lattice_distance` units):
# the immediate neighbours first, then the next ring once those are all launched.
LOCAL_RADII = DEFAULT_POLICY.local_radii  # optimizer.policy


# What kind of proposal a trial was (stored in its `model_prediction`; api.documents shows it);
# "start": not the model's proposal (a starting point a fleet launched blind, a warm start, TPE's
# fallback) but predicted while it was in flight (`in_flight_predictions`).
Move = Literal["model", "local", "probe", "start"]


@dataclass(frozen=True)
class Proposal:
    config: SpecConfig
    predicted_speedup: float
    predicted_sd: float  # of the log speedup
    expected_improvement: float
    observations: int
    p_fail: float = 0.0  # of running out of memory, by the learnt boundary
    cost_s: float = 0.0  # predicted start-up + benchmark seconds
    # "model": the model's best value; "local": a neighbour of the incumbent, chosen because the
    # model failed its prediction check (optimizer.stop_rules) and its argmax is not to be trusted;
    # "probe": one draft step past the deepest launch; "start": not the model's proposal, predicted
    # in flight (`in_flight_predictions`).
    move: Move = "model"
    around: str | None = None  # "local": the incumbent walked around (its configuration key)
    # Why a configuration the model predicts to lose by more than LOSE_BY was proposed anyway
    # (None: it was not predicted to lose): stored on the trial as attrs.PROPOSAL_PURPOSE.
    purpose: str | None = None


@functools.lru_cache(maxsize=32)
def _space_configs(space_json: str) -> tuple[SpecConfig, ...]:
    return tuple(SearchSpace.model_validate_json(space_json).iter_configs())


def space_configs(space: SearchSpace) -> tuple[SpecConfig, ...]:
    return _space_configs(space.model_dump_json())


def _tried_keys(trials: Sequence[FrozenTrial]) -> set[str]:
    keys = set()
    for r in A.records(trials):
        if r.config_key is not None:
            keys.add(r.config_key)
    return keys


def _best_measured(trials: Sequence[FrozenTrial]) -> float | None:
    best = best_measured_trial(trials)
    return None if best is None else float(best.value or 0.0)


def best_measured_trial(trials: Sequence[FrozenTrial]) -> FrozenTrial | None:
    """The feasible measured trial with the best value (the incumbent)."""
    best: FrozenTrial | None = None
    for t in trials:
        if t.state != TrialState.COMPLETE or t.value is None or t.value <= 0:
            continue
        if t.constraints and any(v > 0 for v in t.constraints.values()):
            continue
        if not A.TrialRecord(t).has_config:
            continue
        if best is None or t.value > (best.value or 0.0):
            best = t
    return best


@dataclass(frozen=True)
class OpenPool:
    """Configurations still worth a launch, with each one's probability of running out of memory."""

    configs: list[SpecConfig]
    p_fail: FloatArray
    pending: list[SpecConfig]


def pending_configs(trials: Sequence[FrozenTrial]) -> list[SpecConfig]:
    """Configurations in flight (asked, leased, not yet told)."""
    return [r.config for r in A.records(trials) if r.state == TrialState.RUNNING and r.has_config]


def open_pool(spec: StudySpec, trials: Sequence[FrozenTrial], policy: Policy = DEFAULT_POLICY) -> OpenPool:
    """Never launched, not in flight, not known to fail, and not a probable failure (of its launch,
    or of its deployment where the serving envelope is fixed) by the memory model learnt so far
    (under the study's `policy`)."""
    tried = _tried_keys(trials)
    ooms = oom_points(trials)
    pool = [c for c in space_configs(spec.search_space) if c.key not in tried]
    if ooms:
        pool = [c for c in pool if known_to_fail(c, ooms) is None]
    # The memory model in the deployment's terms (optimizer.deployability): p_fail is the chance
    # that the launch or the answer's deployment runs out of memory.
    w = deployability.weigh(spec, trials, pool, policy)
    pool = [c for c, k in zip(pool, w.keep, strict=True) if k]
    return OpenPool(pool, w.p_fail[w.keep], pending_configs(trials))


def _lattice(c: SpecConfig, space: SearchSpace) -> tuple[int, int, int, int]:
    """A configuration's place on the space's own grid: steps, topk's and graph size's positions
    in the space's lists, draft tokens."""
    topks = sorted(space.topk)
    graphs = sorted(space.cuda_graph_max_bs or [])
    k = topks.index(c.topk) if c.topk in topks else 0
    g = graphs.index(c.cuda_graph_max_bs) if c.cuda_graph_max_bs in graphs else 0
    return c.num_steps, k, g, c.num_draft_tokens


def _ndt_step(c: SpecConfig) -> float:
    return max(1.0, round(c.num_draft_tokens / 10))


def lattice_distance(ref: SpecConfig, pool: Sequence[SpecConfig], space: SearchSpace) -> FloatArray:
    """Moves on the space's own grid from `ref` to each configuration: one per draft step, one per
    topk choice (and graph size choice) in the space's list, and one per draft-token step, which is
    a tenth of ref's draft tokens (at least 1).  A chain's draft tokens follow its steps, so
    between two chains only the steps count.

    This is the neighbourhood a search without a model walks: nothing about how throughput
    depends on the flags, only which flags sit next to each other.
    """
    rs, rk, rg, rn = _lattice(ref, space)
    step = _ndt_step(ref)
    out = np.empty(len(pool))
    for i, c in enumerate(pool):
        s, k, g, n = _lattice(c, space)
        d = float(abs(s - rs) + abs(k - rk) + abs(g - rg))
        if not (c.topk == 1 and ref.topk == 1):
            d += abs(n - rn) / step
        out[i] = d
    return out


@dataclass(frozen=True)
class LocalMoves:
    """The incumbent's unlaunched neighbours (indices into the pool), and for each whether it
    carries on a slope (`onward`: its mirror image through the incumbent was measured, so the
    incumbent beat the step the other way; pattern search's move after a success)."""

    index: np.ndarray
    onward: FloatArray


def _mirror_key(c: SpecConfig, space: SearchSpace) -> tuple[int, int, int, int]:
    s, k, g, n = _lattice(c, space)
    return s, k, g, -1 if c.topk == 1 else n  # a chain's draft tokens follow its steps


def local_moves(
    ref: SpecConfig,
    pool: Sequence[SpecConfig],
    space: SearchSpace,
    measured: Sequence[SpecConfig] = (),
    radii: Sequence[float] = LOCAL_RADII,
) -> LocalMoves:
    """The incumbent's nearest unlaunched neighbours (the first ring of `radii`, the study's
    `Policy.local_radii`, that has any).

    `measured`: the configurations with a result; a neighbour whose mirror image through the
    incumbent is one of them is "onward" (the incumbent beat that side, so the slope points this
    way).
    """
    empty = LocalMoves(np.zeros(0, dtype=int), np.zeros(0))
    if not pool:
        return empty
    dist = lattice_distance(ref, pool, space)
    idx = np.zeros(0, dtype=int)
    for r in radii:
        idx = np.flatnonzero((dist > 0) & (dist <= r + 1e-9))
        if idx.size:
            break
    if not idx.size:
        return empty
    seen = {_mirror_key(c, space) for c in measured if c.key != ref.key}
    centre = np.array(_mirror_key(ref, space))
    onward = np.zeros(idx.size)
    for j, i in enumerate(idx):
        c = pool[i]
        here = np.array(_mirror_key(c, space))
        mirror = 2 * centre - here
        if (c.topk == 1) != (ref.topk == 1):
            continue  # between a chain and a tree the draft tokens do not mirror
        onward[j] = float(tuple(int(x) for x in mirror) in seen)
    return LocalMoves(idx, onward)


def pending_penalty(
    pool: Sequence[SpecConfig], pending: Sequence[SpecConfig], near_copy: float = NEAR_COPY
) -> FloatArray:
    """Factor on each candidate's value: 0 for a near-copy (closer than `near_copy`, the study's
    `Policy.near_copy`) of a configuration in flight, rising to
    1 away from them (what the pending launch will teach about its neighbours is not worth a
    second launch now)."""
    out = np.ones(len(pool))
    if not pending or not pool:
        return out
    a, b = coords(pool), coords(pending)
    d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(axis=2)
    for j in range(len(pending)):
        out *= np.where(d2[:, j] < near_copy**2, 0.0, 1.0 - np.exp(-d2[:, j] / 2.0))
    return out


def propose(
    spec: StudySpec,
    trials: Sequence[FrozenTrial],
    rng: random.Random,
    model: FittedModel | None = None,
    policy: Policy = DEFAULT_POLICY,
    shapes: Mapping[str, VerifyShape] | None = None,
) -> Proposal | None:
    """The configuration to measure next, or None when the model has nothing to go on.

    Value = expected improvement x (1 - probability of running out of memory) x the penalty
    around configurations in flight, per expected second of launch and benchmark
    (optimizer.launch_cost).  `policy` is the study's (the snapshot's, optimizer.policy): its
    prediction check decides whether the model is trusted or the walk around the incumbent runs,
    as the stop rule's does (a `--policy check_level=1.0` that switched the check off in the stop
    rule alone would leave the sampler walking for a rule that no longer waits for the walk).
    """
    if model is None:
        model = fit(observations_of(trials), spec.search_space.num_steps.high, shapes, policy)
    if model is None:
        return None
    op = open_pool(spec, trials, policy)
    pool, p_fail = op.configs, op.p_fail
    if not pool:
        return None
    if len(pool) > MAX_SCORED:
        # A random subset, plus the best measured configuration's neighbours (the local moves).
        keep = set(rng.sample(range(len(pool)), MAX_SCORED))
        top = best_measured_trial(trials)
        if top is not None:
            near = (
                lattice_distance(A.TrialRecord(top).config, pool, spec.search_space) <= max(policy.local_radii) + 1e-9
            )
            keep.update(int(i) for i in np.flatnonzero(near))
        idx = sorted(keep)
        pool, p_fail = [pool[i] for i in idx], p_fail[idx]
    cand = Candidates.of(pool)
    levels, weights = objective_levels(spec)
    mean, sd = model.predict_log_speedup(cand, levels, weights)
    # The study's launch prices, fitted once for this ask (optimizer.decide.Prices).
    prices = decide.prices(spec, trials, policy)
    # LOSE_BY: what the model itself expects to lose by more than 20% to the best measured so far.
    best_so_far = _best_measured(trials)
    bar = math.log((1.0 - policy.lose_by) * max(1.0, best_so_far or 0.0))
    loses = mean < bar
    # What the prediction claims about the value itself: the stop rule checks each result against
    # it (optimizer.stop_rules), so it is stored apart from the sd the choice below is made with.
    sd_value = sd
    best = best_measured_trial(trials)
    if best is not None and float(best.value or 0.0) > 1.0:
        # The question the convergence stop asks (optimizer.convergence): how much may each
        # candidate beat the bar, as the model sees both, by more than min_gain?  Measuring
        # where that is most likely also settles the study soonest.  The bar is the incumbent,
        # or where the model ranks the confirmed candidates, the one it ranks first.
        check = stop_rules.prediction_check(trials, policy)
        ref = A.TrialRecord(ranking.bar_of(spec, trials, model, check, best, policy)).config
        diff, sd = gain_over(spec, model, pool, ref)
        z = beat_z(diff, sd, spec.budget.min_gain, None)
        # The stop rule's chance (optimizer.convergence: what one launch may move the answer by).
        noise = stop_rules.launch_variance(trials, policy) if policy.answer_moves else None
        # Per GPU-second, as the stop rule weighs it (optimizer.decide).
        priced = prices.relative(pool, np.exp(mean), p_fail)
        settles = float((norm.cdf(beat_z(diff, sd, spec.budget.min_gain, noise)) / priced).max()) < policy.p_matters
        if policy.depth_probe and not op.pending and settles and check.trusted:
            # The model sees nothing left to beat the incumbent: where the incumbent is the
            # deepest launch, the stop rule first wants one launch past it (stop_rules.depth_probe).
            probe = stop_rules.depth_probe(trials, ref, pool, spec.search_space.num_steps.high)
            if probe is not None:
                i = pool.index(probe)
                return Proposal(
                    config=probe, predicted_speedup=float(math.exp(mean[i])), predicted_sd=float(sd_value[i]),
                    expected_improvement=0.0, observations=model.n_observations, p_fail=float(p_fail[i]),
                    move="probe", purpose=_PURPOSE_PROBE if loses[i] else None,
                )  # fmt: skip
    else:
        # Nothing pays yet: improvement over the baseline (or the best so far, if above it).
        incumbent = max(math.log(float(best.value or 1.0)) if best is not None else float(mean.max()), 0.0)
        if best is None:
            incumbent = float(mean.max())
        z = (mean - incumbent) / sd
    ei = sd * (z * norm.cdf(z) + norm.pdf(z))
    penalty = pending_penalty(pool, op.pending, policy.near_copy)
    cost = prices.fit.seconds(pool, np.exp(mean), p_fail)
    value = ei * (1.0 - p_fail) * penalty / (cost / float(np.median(cost)))
    local = _local_moves(spec, trials, pool, best, policy)
    around: str | None = None
    move: Move
    if local is not None:
        # The model failed its prediction check: its argmax is where a wrong model points, and the
        # incumbent's neighbours it rates low are what it never tries.  Walk them (pattern search
        # on the space's grid): onward where the incumbent beat the step the other way, the
        # model's value deciding only among equals.  A
        # neighbour of a launch in flight is not excluded (the model's "it will teach us about its
        # neighbours" is what failed); a near-copy of one goes last.
        move = "local"
        assert best is not None  # local moves walk around a measured incumbent
        around = A.TrialRecord(best).config_key
        v = (ei * (1.0 - p_fail))[local.index]
        clear = penalty[local.index] > 0
        # LOSE_BY: a neighbour the model expects to lose goes after every other.
        first = np.lexsort((-mean[local.index], -np.round(v, 12), ~clear, -local.onward, loses[local.index]))
        i = int(local.index[first[0]])
        purpose = _PURPOSE_WALK if loses[i] else None
    else:
        if not penalty.any():
            return None
        move = "model"
        # LOSE_BY: what the model expects to lose by more than 20% is not worth a launch while
        # anything else is open (its EI is the width of an interval the model cannot narrow
        # cheaper elsewhere); when nothing else is, the one with the most value resolves the most.
        ok = ~loses & (penalty > 0)
        purpose = None
        if not ok.any():
            ok = penalty > 0
            purpose = _PURPOSE_ALL_LOSE
        # Ties (flat value far from the incumbent) go to the higher mean, then to the smaller
        # server (fewer draft tokens, shorter graph capture).
        order = np.lexsort((cand.ndt, -mean, -np.round(np.where(ok, value, -1.0), 12)))
        i = int(order[0])
    return Proposal(
        config=cand.configs[i],
        predicted_speedup=float(math.exp(mean[i])),
        predicted_sd=float(sd_value[i]),
        expected_improvement=float(ei[i]),
        observations=model.n_observations,
        p_fail=float(p_fail[i]),
        cost_s=float(cost[i]),
        move=move,
        around=around,
        purpose=purpose,
    )


# The purposes an exception to LOSE_BY states (attrs.PROPOSAL_PURPOSE).
_PURPOSE_PROBE = (
    "depth probe: resolve the acceptance past the deepest draft position launched, which the model "
    "extrapolates (optimizer.stop_rules.depth_probe)"
)
_PURPOSE_WALK = (
    "walk around the incumbent: the model failed its prediction check, so its ranking of the "
    "incumbent's neighbours is the part being resolved"
)
_PURPOSE_ALL_LOSE = (
    "every open configuration is predicted to lose by more than 20%: resolve where the model is least sure"
)


def _local_moves(
    spec: StudySpec,
    trials: Sequence[FrozenTrial],
    pool: Sequence[SpecConfig],
    best: FrozenTrial | None,
    policy: Policy = DEFAULT_POLICY,
) -> LocalMoves | None:
    """The model-free local moves, or None: only when the model failed its prediction check (at
    the study's `policy`), a configuration beats the baseline (the incumbent to walk around) and a
    neighbour is open."""
    if best is None or float(best.value or 0.0) <= 1.0:
        return None
    if stop_rules.prediction_check(trials, policy).trusted:
        return None
    measured = stop_rules.launched_configs(trials)
    moves = local_moves(A.TrialRecord(best).config, pool, spec.search_space, measured, policy.local_radii)
    return moves if moves.index.size else None


def prediction_attr(proposal: Proposal) -> dict[str, Any]:
    """The trial's `model_prediction` as stored (JSON); api.documents.ModelPrediction shows it."""
    out: dict[str, Any] = json.loads(
        json.dumps(
            {
                "speedup": proposal.predicted_speedup,
                "log_sd": proposal.predicted_sd,
                "expected_improvement": proposal.expected_improvement,
                "observations": proposal.observations,
                "p_oom": proposal.p_fail,
                "predicted_cost_s": proposal.cost_s,
                "move": proposal.move,
                "around": proposal.around,
            }
        )
    )
    return out


# What a start's prediction leaves out: nothing weighed it as a proposal (api.documents shows None).
NOT_ESTIMATED: dict[str, Any] = {"expected_improvement": None, "p_oom": None, "predicted_cost_s": None}


def in_flight_predictions(
    spec: StudySpec, trials: Sequence[FrozenTrial], model: FittedModel | None, asking: int
) -> list[tuple[FrozenTrial, dict[str, Any]]]:
    """Predictions for the launches in flight that carry none, by a model that has not seen their
    results (it is fitted on finished trials only): the prediction check (optimizer.stop_rules)
    tests them like any proposal's.  Mostly the starting points a fleet launched blind, before the
    model had anything to stand on (also warm starts and TPE's fallback).  A fleet launches its
    first points together, so without these the model's first predictions are the ones it
    proposes after them: four hosts checked it on fewer launches than two by the time the search
    settled, and the confirmation could not let it rank the runners-up (optimizer.ranking).  Each
    is made once, by the first fit that finds the launch in flight: at an ask or at another
    launch's result (`ModelSampler.before_trial`, `after_trial`; a start whose result is in before
    any model exists is never predicted).  The trial `asking` is the one being asked or told (a
    proposal's prediction comes with it; a result is not predicted as it arrives).  What a
    proposal also estimates (its expected improvement, risk of running out of memory and cost) is
    left out: None, not estimated."""
    if model is None:
        return []
    out: list[tuple[FrozenTrial, dict[str, Any]]] = []
    levels, weights = objective_levels(spec)
    for t in trials:
        if t.number == asking or not _unpredicted(t):
            continue
        r = A.TrialRecord(t)
        mean, sd = model.predict_log_speedup(Candidates.of([r.config]), levels, weights)
        start = Proposal(r.config, float(math.exp(mean[0])), float(sd[0]), 0.0, model.n_observations, move="start")
        out.append((t, prediction_attr(start) | NOT_ESTIMATED))
    return out


def blind_start(spec: StudySpec, trials: Sequence[FrozenTrial], policy: Policy = DEFAULT_POLICY) -> SpecConfig | None:
    """A starting point for a worker that asks before any result is in (a fleet of more hosts than
    the warm starts): the first of the configurations published for the objective's largest
    level (`space.published_starts`, busy from the study's `policy.busy_from`) that fits the
    space and was not asked yet,
    or None (TPE's random start) once they are taken or any trial has finished (with a result, a
    failure or an out-of-memory start: what is known to fail is then the memory model's).

    Measured (benchmarks/README.md, "Where a fleet of four spends its extra launches"): with 4
    workers, random starting points cost a search launch over 2 workers on four of nine cases.
    """
    if any(t.state.is_finished() for t in trials):
        return None
    tried = _tried_keys(trials)
    for d in published_starts(max(objective_levels(spec)[0]), policy.busy_from):
        c = with_largest_graph(d, spec.search_space)  # as the defaults (optimizer.study.warm_start_configs)
        if c.key not in tried and spec.search_space.contains(c):
            return c
    return None


def _unpredicted(t: FrozenTrial) -> bool:
    """A launch in flight that carries no prediction."""
    r = A.TrialRecord(t)
    return t.state == TrialState.RUNNING and r.model_prediction is None and r.has_config


def _predict_in_flight(
    study: Study,
    spec: StudySpec,
    trials: Sequence[FrozenTrial],
    asking: int,
    shapes: Mapping[str, VerifyShape] | None = None,
    policy: Policy = DEFAULT_POLICY,
) -> tuple[bool, FittedModel | None]:
    """Fit the model and store `in_flight_predictions`: (done, the fit); done is False when it
    failed.

    Runs inside Optuna's ask and tell (the sampler's hooks), where anything raised would fail the
    lease or the report it serves, or leave a trial no one tells: a prediction is the check's
    evidence, not their purpose, so a failure is logged and the ask or tell goes on."""
    try:
        model = fit(observations_of(trials), spec.search_space.num_steps.high, shapes, policy)
        _record_in_flight(study, in_flight_predictions(spec, trials, model, asking))
    except Exception:  # noqa: BLE001 - see the docstring: never fail the ask or the tell for this
        log.warning("study %s: no in-flight predictions at trial %d", study.study_name, asking, exc_info=True)
        return False, None
    return True, model


def _record_in_flight(study: Study, predictions: Sequence[tuple[FrozenTrial, dict[str, Any]]]) -> None:
    """Store `in_flight_predictions` on their trials.  A prediction is the check's evidence, not
    the ask's purpose: one that cannot be stored (the result came in meanwhile, or the storage
    failed) is left out, and the ask goes on."""
    for running, prediction in predictions:
        try:
            study._storage.set_trial_user_attr(running._trial_id, PREDICTION_ATTR, prediction)  # noqa: SLF001
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # its result came in meanwhile: too late to predict it
        except optuna.exceptions.StorageInternalError as e:
            log.warning("trial %d: its in-flight prediction was not stored (%s)", running.number, e)


class ModelSampler(BaseSampler):
    """Optuna sampler around `propose`; TPE for anything the model cannot answer."""

    def __init__(
        self,
        spec: StudySpec,
        seed: int | None = None,
        fallback: BaseSampler | None = None,
        policy: Policy = DEFAULT_POLICY,
        shapes: Mapping[str, VerifyShape] | None = None,
    ) -> None:
        self._spec = spec
        # The study's policy (the snapshot's: optimizer.memory_store hands it over), for `propose`.
        self._policy = policy
        # The hosts' probed verify cost (optimizer.verify_probe): every fit here reads it, as the
        # conductor's stop rule and ranking do from the same baselines.
        self._shapes = shapes
        self._rng = random.Random(seed)
        self._fallback = fallback or optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)
        # (trial number, the trials read, their fit): `before_trial`'s, for this ask's `sample_relative`.
        self._fitted: tuple[int, list[FrozenTrial], FittedModel | None] | None = None

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        """Every ask, enqueued warm starts included (Optuna calls this before any parameter is
        sampled, where a trial whose parameters are all fixed never reaches `sample_relative`):
        the launches in flight get their predictions (`in_flight_predictions`).  The fit is kept
        for this trial's `sample_relative`.  Optuna calls it too whenever a `Trial` is built for a
        trial asked before (optimizer.study tells a result through one): those have parameters,
        and are left alone (an orphan asked without any is predicted for, harmlessly)."""
        self._fitted = None
        if trial.params:
            return
        trials = study.get_trials(deepcopy=False)
        done, model = _predict_in_flight(study, self._spec, trials, trial.number, self._shapes, self._policy)
        if done:  # else `sample_relative` fits again, and says what went wrong if it does again
            self._fitted = (trial.number, trials, model)

    def after_trial(self, study: Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None) -> None:
        """Every result (Optuna calls this in `tell`, before the trial is stored as finished): the
        launches still in flight that carry no prediction get one now, from the results before
        this one, rather than at the next ask, which a fleet that waits may not make before their
        results are in.  Only the launches in flight are read, and nothing is fitted, when each
        of them carries a prediction (a tell's usual case, on the report's path)."""
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if any(_unpredicted(t) and t.number != trial.number for t in running):
            _predict_in_flight(
                study, self._spec, study.get_trials(deepcopy=False), trial.number, self._shapes, self._policy
            )

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return distributions(self._spec.search_space)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if "fixed_params" in trial.system_attrs:
            return {}  # an enqueued warm start: its params win anyway
        if self._fitted is not None and self._fitted[0] == trial.number:
            _, trials, model = self._fitted  # read and fitted by `before_trial`, moments ago
        else:
            trials = study.get_trials(deepcopy=False)
            model = fit(observations_of(trials), self._spec.search_space.num_steps.high, self._shapes, self._policy)
        proposal = None if model is None else propose(self._spec, trials, self._rng, model, self._policy, self._shapes)
        if proposal is None:
            start = blind_start(self._spec, trials, self._policy)
            if start is None:
                return {}  # TPE, parameter by parameter (sample_independent)
            return {k: v for k, v in params_of(start).items() if k in search_space}
        study._storage.set_trial_user_attr(  # noqa: SLF001 - the sampler has only the frozen trial
            trial._trial_id,  # noqa: SLF001
            PREDICTION_ATTR,
            prediction_attr(proposal),
        )
        if proposal.purpose is not None:
            study._storage.set_trial_user_attr(trial._trial_id, A.PROPOSAL_PURPOSE, proposal.purpose)  # noqa: SLF001
        params: dict[str, Any] = dict(params_of(proposal.config))
        return {k: v for k, v in params.items() if k in search_space}

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)
