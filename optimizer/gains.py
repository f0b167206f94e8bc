"""How much the performance model expects one configuration to gain over another.

What the sampler aims with (optimizer.model_sampler) and what the ranking of candidates is built
on (optimizer.ranking): both import it, so neither imports the other for it (the sampler asks the
ranking for the bar its proposals must beat).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from optuna.trial import FrozenTrial, TrialState

from optimizer import attrs as A
from optimizer.perf_model import Candidates, FittedModel, FloatArray, Observation, observations_from_attrs
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec


def objective_levels(spec: StudySpec) -> tuple[list[int], list[float]]:
    if spec.objective.concurrency is not None:
        return [spec.objective.concurrency], [1.0]
    levels = list(spec.workload.concurrency)
    return levels, [1.0] * len(levels)


def observations_of(trials: Sequence[FrozenTrial]) -> list[Observation]:
    out: list[Observation] = []
    for r in A.records(trials):
        if r.state not in (TrialState.COMPLETE, TrialState.PRUNED) or r.has(A.DUPLICATE_OF):
            continue
        if not r.has(A.LEVELS) or not r.has_config:
            continue
        obs = observations_from_attrs(r.config.model_dump(mode="json"), r.levels, r.baseline_levels, r.worker_id)
        # A believed launch (optimizer.believer) lies on the fit by construction: the fixed form
        # takes it, the residual GP does not (it would only shrink the misfit sized on real results).
        believed = r.has(A.BELIEVED)
        out.extend(dataclasses.replace(o, believed=True) if believed else o for o in obs)
    return out


def coords(configs: Sequence[SpecConfig]) -> FloatArray:
    """Where a configuration sits for "how alike are two servers": steps in twos, log2 topk,
    log2 draft tokens in halves."""
    return np.array(
        [[c.num_steps / 2.0, math.log2(c.topk), 2.0 * math.log2(c.num_draft_tokens)] for c in configs], dtype=float
    ).reshape(len(configs), 3)


def gain_over(
    spec: StudySpec, model: FittedModel, pool: Sequence[SpecConfig], ref: SpecConfig, floor_sd: float | None = None
) -> tuple[FloatArray, FloatArray]:
    """Mean and sd of log(candidate / incumbent) by the model (FittedModel.predict_gain).

    The model's misspecification floor (`floor_sd` far from the incumbent; the convergence stop
    passes what the model's own predictions missed by) hits a near-copy of the incumbent as much
    as the incumbent itself, so it grows with the distance between the two servers (`coords`).
    None: the floor of the policy the model was fitted under.
    """
    floor_sd = model.policy.model_floor if floor_sd is None else floor_sd
    levels, weights = objective_levels(spec)
    dist = np.sqrt(((coords(pool) - coords([ref])) ** 2).sum(axis=1))
    floor = floor_sd * np.minimum(1.0, dist / 8.0)
    return model.predict_gain(Candidates.of(pool), Candidates.of([ref]), levels, weights, floor)


def moved_sd(sd: FloatArray, launch_var: float) -> FloatArray:
    """How far one launch of each candidate may move the model's estimate of it: the sd of the
    posterior mean after one result measured with noise variance `launch_var` (the preposterior).

    A Gaussian update moves the mean by the gain sd²/(sd² + v) times a surprise of sd
    sqrt(sd² + v), so by sd²/sqrt(sd² + v).  The study answers with the model's ranking, not with a
    launch's raw result (optimizer.ranking), so a launch changes the answer only as far as it
    moves the model: where launch noise is as large as what the model is unsure of, one launch
    moves it by half as much or less ("Knowledge gradient", Frazier, Powell and Dayanik 2009,
    restated in docs/search.md).
    """
    return sd * sd / np.sqrt(sd * sd + launch_var)


def beat_z(diff: FloatArray, sd: FloatArray, min_gain: float, launch_var: float | None) -> FloatArray:
    """How many sd each candidate's estimated gain `diff` (log, sd `sd`) lies above `min_gain`: of
    its value, or with `launch_var` of what one launch of it can move the estimate to (`moved_sd`).
    The stop rule's chance (optimizer.convergence) and the sampler's depth-probe gate ask this one."""
    spread = sd if launch_var is None else moved_sd(sd, launch_var)
    return (diff - math.log1p(min_gain)) / spread
