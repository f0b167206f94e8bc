"""Sampler choice for a study (spec field `sampler`)."""

from __future__ import annotations

import optuna

from optimizer.spec import StudySpec


def make_sampler(spec: StudySpec, seed: int | None) -> optuna.samplers.BaseSampler:
    """`tpe` (default), `gp`, `random`, `grid` (enqueued at creation; random behind it), `auto`.

    TPE runs with Optuna 5.0's defaults: multivariate and constant liar, so RUNNING trials on
    other workers count as pessimistic guesses instead of being proposed again.
    `auto` is TPE for now: our space has categorical and conditional parameters, which is where
    OptunaHub's AutoSampler picks TPE too.
    """
    name = spec.sampler
    if name in ("tpe", "auto"):
        # Few start-up trials: every trial is a server restart (minutes of GPU time), and the
        # warm-start configurations already spread over the space.
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=5)
    if name in ("random", "grid"):
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"unknown sampler {name!r}")
