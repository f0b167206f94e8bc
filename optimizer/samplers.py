"""Sampler choice for a study (spec field `sampler`)."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping

import optuna

from optimizer.errors import SpecError
from optimizer.model_sampler import ModelSampler
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.spec import StudySpec
from optimizer.verify_probe import VerifyShape

log = logging.getLogger("spectune.optimizer")

# torch is an optional extra (`gp`): the API host's `server` install must not pull a CUDA build.
GP_INSTALL_HINT = (
    "sampler 'gp' needs torch, which this API host does not have: install the CPU build and the gp extra "
    "(pip install --index-url https://download.pytorch.org/whl/cpu torch, then pip install '<wheel or checkout>[server,gp]'), "
    "or use sampler 'auto' or 'tpe'"
)


def gp_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def check_sampler_installed(spec: StudySpec) -> None:
    """SpecError (422 at the API) when the spec's sampler needs a package this host lacks."""
    if spec.sampler == "gp" and not gp_available():
        raise SpecError("sampler", GP_INSTALL_HINT)


def make_sampler(
    spec: StudySpec,
    seed: int | None,
    policy: Policy = DEFAULT_POLICY,
    shapes: Mapping[str, VerifyShape] | None = None,
) -> optuna.samplers.BaseSampler:
    """`tpe` (default), `gp`, `random`, `grid` (enqueued at creation; random behind it), `auto`.

    TPE runs with Optuna 5.0's defaults: multivariate and constant liar, so RUNNING trials on
    other workers count as pessimistic guesses instead of being proposed again.
    `auto` is spectune's model-based sampler (`optimizer.model_sampler`): it fits accept length
    and cycle time from the trials so far and proposes the configuration with the largest
    expected improvement; benchmarks/search_efficiency.py measures that it needs far fewer
    restarts than TPE, random search or SGLang's own grid.  `policy` (the study's) and `shapes` (the
    hosts' probed verify cost, optimizer.verify_probe) reach `auto`'s model only: the others read
    no decision value of optimizer.policy and no model.
    """
    name = spec.sampler
    if name == "auto":
        return ModelSampler(spec, seed, policy=policy, shapes=shapes)
    if name == "tpe":
        # Few start-up trials: every trial is a server restart (minutes of GPU time), and the
        # warm-start configurations already spread over the space.
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)
    if name == "gp":
        if not gp_available():
            # A gp study created where torch was installed, now served by an API process without
            # it: creation refuses this (check_sampler_installed), but a running study must still
            # hand out work, so it asks TPE and says so.  What is measured does not change.
            log.warning("study %s: sampler gp needs torch, which this API process lacks; asking TPE", spec.name)
            return optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=5)
    if name in ("random", "grid", "list"):
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"unknown sampler {name!r}")
