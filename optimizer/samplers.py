"""Sampler choice for a study (spec field `sampler`)."""

from __future__ import annotations

import optuna

from optimizer.model_sampler import ModelSampler
from optimizer.spec import StudySpec


def make_sampler(spec: StudySpec, seed: int | None) -> optuna.samplers.BaseSampler:
    """`tpe` (default), `gp`, `random`, `grid` (enqueued at creation; random behind it), `auto`.

    TPE runs with Optuna 5.0's defaults: multivariate and constant liar, so RUNNING trials on
    other workers count as pessimistic guesses instead of being proposed again.
    `auto` is spectune's model-based sampler (`optimizer.model_sampler`): it fits accept length
    and cycle time from the trials so far and proposes the configuration with the largest
    expected improvement; benchmarks/search_efficiency.py measures that it needs far fewer
    restarts than TPE, random search or SGLang's own grid.
    """
    name = spec.sampler
    if name == "auto":
        return ModelSampler(spec, seed)
    if name == "tpe":
        # Few start-up trials: every trial is a server restart (minutes of GPU time), and the
        # warm-start configurations already spread over the space.
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=5)
    if name in ("random", "grid", "list"):
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"unknown sampler {name!r}")
