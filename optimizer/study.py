"""Optuna studies for EAGLE-3 tuning: creation, asking for a configuration, telling results.

How the search space maps onto Optuna (define-by-run at ask time, in the service):

* `num_steps`  IntDistribution(low, high)
* `topk`       CategoricalDistribution(choices)
* `num_draft_tokens` IntDistribution(low, high), suggested only when topk > 1: with a chain SGLang
  derives it (steps + 1), so it is not a free parameter and never appears in a chain's params;
* `cuda_graph_max_bs` CategoricalDistribution, only when the spec tunes it.

Distributions never change between trials (TPE and GP need that); a tree's draft-token count
above what SGLang can fill is clamped to what SGLang can fill (`SearchSpace.config_from_params`), and the
service de-duplicates launches by the canonical key.

Failures teach the sampler (docs/optuna.md §5): a configuration that cannot run is told as
COMPLETE with a violated constraint and a pessimistic but plausible value; infrastructure
faults are told FAIL (invisible to the samplers) after their retries.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from optimizer import attrs as A
from optimizer.errors import StudyExistsError, StudyNotFoundError, TrialStateError
from optimizer.objective import CONSTRAINT_KEY, FAILED_LAUNCH_VIOLATION
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.samplers import check_sampler_installed, make_sampler
from optimizer.space import SGLANG_DEFAULTS, SpecConfig, params_of, with_largest_graph
from optimizer.spec import StudySpec
from optimizer.verify_probe import VerifyShape

SPEC_ATTR = "spectune_spec"
METRIC_NAMES = ["speedup"]


@dataclass(frozen=True)
class AskedTrial:
    number: int
    trial_id: int
    params: dict[str, Any]
    config: SpecConfig


def warm_start_configs(spec: StudySpec, prior: Sequence[SpecConfig] = ()) -> list[SpecConfig]:
    """The user's warm starts, then `prior` (best configurations of earlier studies of the same
    model and hardware), then SGLang's own defaults, each once and only where they fit the space."""
    space = spec.search_space
    out: list[SpecConfig] = []
    seen: set[str] = set()
    candidates = list(spec.warm_start) + list(prior)
    candidates += [with_largest_graph(d, space) for d in SGLANG_DEFAULTS]
    for cfg in candidates:
        c = cfg.canonical()
        if c.key not in seen and space.contains(c):
            seen.add(c.key)
            out.append(c)
    return out


def create_study(storage: BaseStorage, spec: StudySpec, prior: Sequence[SpecConfig] = ()) -> optuna.Study:
    check_sampler_installed(spec)  # before anything is stored: a gp study without torch never starts
    try:
        study = optuna.create_study(storage=storage, study_name=spec.name, direction="maximize")
    except optuna.exceptions.DuplicatedStudyError as e:
        raise StudyExistsError(spec.name) from e
    study.set_user_attr(SPEC_ATTR, spec.model_dump(mode="json"))
    # optuna-dashboard labels its plots with it: the objective's metric, where it is not throughput.
    name = spec.objective.name
    study.set_metric_names(METRIC_NAMES if name == "throughput" else [f"{name} speedup"])
    if spec.sampler == "grid":
        # The grid is the valid, canonical set in a stable order; the sampler behind it is never
        # consulted while enqueued trials remain.
        configs: Iterable[SpecConfig] = spec.search_space.iter_configs()
    elif spec.sampler == "list":
        # A benchmark of given configurations: exactly the warm_start list, in its order.
        configs = [c.canonical() for c in spec.warm_start]
    else:
        configs = warm_start_configs(spec, prior)
    prior_keys = {c.canonical().key for c in prior}
    for cfg in configs:
        source = (
            spec.sampler
            if spec.sampler in ("grid", "list")
            else "prior_study"
            if cfg.key in prior_keys
            else "warm_start"
        )
        study.enqueue_trial(params_of(cfg), user_attrs={A.SOURCE: source})
    return study


# What a caller lets the samplers see of a study's trials (api: an admin-quarantined trial reads
# as FAIL); applied to every read through the study, so TPE, GP, the model sampler and the
# pessimistic value of an infeasible configuration all see the same trials.
TrialScreen = Callable[[list[FrozenTrial]], list[FrozenTrial]]


class ScreenedStudy(optuna.Study):
    """An Optuna study whose trial reads pass through a `TrialScreen`.

    Samplers read trials through `Study._get_trials` (TPE and GP directly, with its per-thread
    cache; `get_trials` calls it too); the screen runs before the state filter, so a trial it
    turns into a failure is gone from a COMPLETE-only read.
    """

    def __init__(
        self,
        study_name: str,
        storage: BaseStorage,
        sampler: optuna.samplers.BaseSampler,
        pruner: optuna.pruners.BasePruner,
        screen: TrialScreen,
    ) -> None:
        super().__init__(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner)
        self._screen = screen

    def _get_trials(
        self, deepcopy: bool = True, states: Container[TrialState] | None = None, use_cache: bool = False
    ) -> list[FrozenTrial]:
        trials = self._screen(super()._get_trials(deepcopy=deepcopy, states=None, use_cache=use_cache))
        return trials if states is None else [t for t in trials if t.state in states]


def load_study(
    storage: BaseStorage,
    spec: StudySpec,
    screen: TrialScreen | None = None,
    policy: Policy = DEFAULT_POLICY,
    shapes: Mapping[str, VerifyShape] | None = None,
) -> optuna.Study:
    """The study with a fresh sampler; with `screen`, every trial read goes through it (ScreenedStudy).
    `policy` is the study's decision values (optimizer.policy), handed to the sampler; `shapes`, the
    hosts' probed verify cost, for the sampler's model (conductor.Snapshot.verify_shapes)."""
    n_trials = _count_trials(storage, spec.name)
    # A fresh sampler per ask: derive its seed from the study's seed and its size, so asks are
    # reproducible for a seeded study without repeating the same proposal every time.
    # Modulo 2**32: numpy (under Optuna's samplers) refuses seeds outside 0..2**32-1, and a large
    # spec seed times the multiplier would leave that range (every ask of the study would fail).
    seed = None if spec.seed is None else (spec.seed * 1_000_003 + n_trials) % 2**32
    sampler = make_sampler(spec, seed, policy, shapes)
    # No Optuna pruner: spectune decides pruning itself, from the noise seen (optimizer.pruning).
    pruner = optuna.pruners.NopPruner()
    try:
        if screen is not None:
            return ScreenedStudy(spec.name, storage, sampler, pruner, screen)
        return optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler, pruner=pruner)
    except KeyError as e:
        raise StudyNotFoundError(spec.name) from e


def _count_trials(storage: BaseStorage, name: str) -> int:
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError as e:
        raise StudyNotFoundError(name) from e
    return storage.get_n_trials(study_id)


def ask(study: optuna.Study, spec: StudySpec) -> AskedTrial:
    trial = study.ask()
    space = spec.search_space
    params: dict[str, Any] = {
        "num_steps": trial.suggest_int("num_steps", space.num_steps.low, space.num_steps.high),
        "topk": trial.suggest_categorical("topk", sorted(space.topk)),
    }
    if params["topk"] > 1:
        n = space.num_draft_tokens
        params["num_draft_tokens"] = trial.suggest_int("num_draft_tokens", n.low, n.high)
    if space.cuda_graph_max_bs is not None:
        params["cuda_graph_max_bs"] = trial.suggest_categorical("cuda_graph_max_bs", sorted(space.cuda_graph_max_bs))
    config = space.config_from_params(params)
    trial.set_user_attr("config", config.model_dump(mode="json"))
    trial.set_user_attr("config_key", config.key)
    return AskedTrial(number=trial.number, trial_id=trial._trial_id, params=params, config=config)  # noqa: SLF001


def _trial_id(study: optuna.Study, number: int) -> int:
    storage = study._storage  # noqa: SLF001 - Optuna offers no public handle by number
    study_id = storage.get_study_id_from_name(study.study_name)
    try:
        return storage.get_trial_id_from_study_id_trial_number(study_id, number)
    except KeyError as e:
        raise TrialStateError(f"study {study.study_name!r} has no trial {number}") from e


def get_trial(study: optuna.Study, number: int) -> FrozenTrial:
    return study._storage.get_trial(_trial_id(study, number))  # noqa: SLF001


def _trial(study: optuna.Study, number: int) -> optuna.Trial:
    trial_id = _trial_id(study, number)
    frozen = study._storage.get_trial(trial_id)  # noqa: SLF001
    if frozen.state.is_finished():
        raise TrialStateError(f"trial {number} of study {study.study_name!r} is already {frozen.state.name}")
    return optuna.Trial(study, trial_id)


def _set_attrs(trial: optuna.Trial, attrs: dict[str, Any]) -> None:
    for k, v in attrs.items():
        # Attrs must be JSON; round-trip to catch numpy floats and the like early.
        trial.set_user_attr(k, json.loads(json.dumps(v)))


def tell_value(study: optuna.Study, number: int, value: float, violation: float, attrs: dict[str, Any]) -> FrozenTrial:
    """A measured result: the speedup, and the latency constraint (<= 0 when satisfied)."""
    if not math.isfinite(value):
        raise TrialStateError(f"refusing to tell a non-finite value {value!r} for trial {number}")
    trial = _trial(study, number)
    _set_attrs(trial, attrs)
    trial.set_constraint(CONSTRAINT_KEY, float(violation))
    return study.tell(trial, value)


def tell_infeasible(study: optuna.Study, number: int, attrs: dict[str, Any]) -> FrozenTrial:
    """The configuration could not run (OOM, invalid, launch timeout): teach the sampler.

    The value is the worst speedup seen so far (1.0 before any), so GP's fit stays plausible,
    and the violated constraint keeps it from ever being chosen as best.
    """
    trial = _trial(study, number)
    _set_attrs(trial, attrs)
    trial.set_constraint(CONSTRAINT_KEY, FAILED_LAUNCH_VIOLATION)
    return study.tell(trial, pessimistic_value(study))


def tell_failed(study: optuna.Study, number: int, attrs: dict[str, Any]) -> FrozenTrial:
    """An infrastructure fault after its retries: FAIL, which samplers ignore."""
    trial = _trial(study, number)
    _set_attrs(trial, attrs)
    return study.tell(trial, state=TrialState.FAIL)


def record_progress(
    study: optuna.Study, number: int, step: int, value: float, attrs: dict[str, Any] | None = None
) -> None:
    """Record an intermediate value (the speedup at the level just measured) and attrs."""
    trial = _trial(study, number)
    trial.report(value, step)
    if attrs:
        _set_attrs(trial, attrs)


def intermediate_values(study: optuna.Study, number: int) -> dict[int, float]:
    return dict(get_trial(study, number).intermediate_values)


def tell_pruned(study: optuna.Study, number: int, attrs: dict[str, Any]) -> FrozenTrial:
    """Stopped early because it could not win: PRUNED (TPE reads it; the model sampler uses its levels)."""
    trial = _trial(study, number)
    _set_attrs(trial, attrs)
    return study.tell(trial, state=TrialState.PRUNED)


def pessimistic_value(study: optuna.Study) -> float:
    values = [
        t.value
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if t.value is not None and is_feasible(t)
    ]
    return min(values) if values else 1.0


def is_feasible(trial: FrozenTrial) -> bool:
    return all(v <= 0 for v in trial.constraints.values()) if trial.constraints else True


def feasible_complete(trials: Iterable[FrozenTrial]) -> list[FrozenTrial]:
    return [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None and is_feasible(t)]


def best_trial_of(trials: Iterable[FrozenTrial]) -> FrozenTrial | None:
    """The best feasible measured trial (Optuna's own best_trial ignores our constraint)."""
    ok = feasible_complete(trials)
    return max(ok, key=lambda t: (t.value, -t.number)) if ok else None
