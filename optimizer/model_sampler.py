"""The `auto` sampler: choose the next configuration with the fitted performance model.

Each ask fits `optimizer.perf_model` to every measured trial (accept length and cycle time per
level, not only the speedup), scores every valid configuration of the space that was never
launched, is not in flight and is not known to run out of memory, and proposes the one with the
largest expected improvement (in log speedup) over the best measurement so far.  The model's
uncertainty (Laplace) makes it try informative configurations while the fit is loose, and go
straight for the predicted optimum once it is tight.

Before any trial carries an accept length (warm starts still running, or an engine that does
not report one) it falls back to TPE, and enqueued warm starts always win (Optuna's fixed
params).  Running trials are excluded, so parallel workers get different proposals.
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState
from scipy.stats import norm

from optimizer.infeasible import known_to_fail, oom_points
from optimizer.params import distributions
from optimizer.perf_model import Candidates, FittedModel, Observation, fit, observations_from_attrs
from optimizer.space import SearchSpace, SpecConfig, params_of
from optimizer.spec import StudySpec

# Above this many valid configurations, score a random subset each ask (plus the neighbours of
# the best measured one); the default space has ~750.
MAX_SCORED = 20_000
PREDICTION_ATTR = "model_prediction"


@dataclass(frozen=True)
class Proposal:
    config: SpecConfig
    predicted_speedup: float
    predicted_sd: float  # of the log speedup
    expected_improvement: float
    observations: int


def objective_levels(spec: StudySpec) -> tuple[list[int], list[float]]:
    if spec.objective.concurrency is not None:
        return [spec.objective.concurrency], [1.0]
    levels = list(spec.workload.concurrency)
    return levels, [1.0] * len(levels)


@functools.lru_cache(maxsize=32)
def _space_configs(space_json: str) -> tuple[SpecConfig, ...]:
    return tuple(SearchSpace.model_validate_json(space_json).iter_configs())


def space_configs(space: SearchSpace) -> tuple[SpecConfig, ...]:
    return _space_configs(space.model_dump_json())


def observations_of(trials: Sequence[FrozenTrial]) -> list[Observation]:
    out: list[Observation] = []
    for t in trials:
        ua = t.user_attrs
        if t.state not in (TrialState.COMPLETE, TrialState.PRUNED) or "duplicate_of" in ua:
            continue
        if "levels" not in ua or "config" not in ua:
            continue
        out.extend(observations_from_attrs(ua["config"], ua["levels"], ua.get("baseline_levels") or []))
    return out


def _tried_keys(trials: Sequence[FrozenTrial]) -> set[str]:
    keys = set()
    for t in trials:
        key = t.user_attrs.get("config_key")
        if key is not None:
            keys.add(key)
    return keys


def _best_measured(trials: Sequence[FrozenTrial]) -> float | None:
    best = None
    for t in trials:
        if t.state != TrialState.COMPLETE or t.value is None or t.value <= 0:
            continue
        if t.constraints and any(v > 0 for v in t.constraints.values()):
            continue
        if best is None or t.value > best:
            best = t.value
    return best


def propose(
    spec: StudySpec, trials: Sequence[FrozenTrial], rng: random.Random, model: FittedModel | None = None
) -> Proposal | None:
    """The configuration to measure next, or None when the model has nothing to go on."""
    if model is None:
        model = fit(observations_of(trials), spec.search_space.num_steps.high)
    if model is None:
        return None
    tried = _tried_keys(trials)
    ooms = oom_points(trials)
    pool = [c for c in space_configs(spec.search_space) if c.key not in tried]
    if ooms:
        pool = [c for c in pool if known_to_fail(c, ooms) is None]
    if not pool:
        return None
    if len(pool) > MAX_SCORED:
        pool = rng.sample(pool, MAX_SCORED)
    cand = Candidates.of(pool)
    levels, weights = objective_levels(spec)
    mean, sd = model.predict_log_speedup(cand, levels, weights)
    best = _best_measured(trials)
    incumbent = math.log(best) if best is not None else float(mean.max())
    z = (mean - incumbent) / sd
    ei = sd * (z * norm.cdf(z) + norm.pdf(z))
    # Ties (flat EI far from the incumbent) go to the higher mean, then to the smaller server
    # (fewer draft tokens, shorter graph capture).
    order = np.lexsort((cand.ndt, -mean, -np.round(ei, 12)))
    i = int(order[0])
    return Proposal(
        config=cand.configs[i],
        predicted_speedup=float(math.exp(mean[i])),
        predicted_sd=float(sd[i]),
        expected_improvement=float(ei[i]),
        observations=model.n_observations,
    )


class ModelSampler(BaseSampler):
    """Optuna sampler around `propose`; TPE for anything the model cannot answer."""

    def __init__(self, spec: StudySpec, seed: int | None = None, fallback: BaseSampler | None = None) -> None:
        self._spec = spec
        self._rng = random.Random(seed)
        self._fallback = fallback or optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return distributions(self._spec.search_space)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if "fixed_params" in trial.system_attrs:
            return {}  # an enqueued warm start: its params win anyway
        trials = study.get_trials(deepcopy=False)
        proposal = propose(self._spec, trials, self._rng)
        if proposal is None:
            return {}
        study._storage.set_trial_user_attr(  # noqa: SLF001 - the sampler has only the frozen trial
            trial._trial_id,  # noqa: SLF001
            PREDICTION_ATTR,
            json.loads(
                json.dumps(
                    {
                        "speedup": proposal.predicted_speedup,
                        "log_sd": proposal.predicted_sd,
                        "expected_improvement": proposal.expected_improvement,
                        "observations": proposal.observations,
                    }
                )
            ),
        )
        params: dict[str, Any] = dict(params_of(proposal.config))
        return {k: v for k, v in params.items() if k in search_space}

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)
