"""How likely a search candidate is to be worth its launch: it starts, and its answer can be deployed.

A trial runs in the tuning envelope (optimizer.plan); the answer is deployed in the printed one
(optimizer.deploy), or, where the serving section leaves the graphs to us, in the smallest graph
envelope a confirmation may fall back to.  Both are judged by one memory model in the
deployment's terms (optimizer.memory_boundary), learnt from every launch of the search, so a
start in the small tuning envelope counts for the deployment only as far as the terms say.

`weigh` gives the sampler (optimizer.model_sampler) each candidate's probability that its launch
or its deployment runs out of memory (the acquisition is multiplied by one minus it), and drops
candidates that probably fail to start (the policy's `probable_failure`), and, where the serving
section fixes the deployed graphs (`serving.max_batch`: no smaller envelope to fall back to),
those the model says surely fail to deploy (its `surely`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from optuna.trial import FrozenTrial

from optimizer.deploy import deployment_envelopes
from optimizer.memory_boundary import (
    FloatArray,
    MemoryBoundary,
    capture_list,
    terms_for,
    tuning_launches,
)
from optimizer.plan import server_settings
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec


@dataclass(frozen=True)
class Weights:
    p_fail: FloatArray  # of the launch or its deployment running out of memory
    keep: NDArray[np.bool_]  # worth proposing at all


def envelope_fixed(spec: StudySpec) -> bool:
    """Does the serving section pin the deployed graphs (no smaller envelope to fall back to)?"""
    return spec.serving is not None and spec.serving.max_batch is not None


def smallest_deployment(spec: StudySpec, config: SpecConfig) -> ServerSettings:
    """The least demanding envelope a confirmation may deploy `config` in (fewest graphs)."""
    envs = [e.settings for e in deployment_envelopes(spec, config)]

    def graphs(s: ServerSettings) -> tuple[int, int]:
        sizes = capture_list(s)
        return len(sizes), sizes[-1]

    return min(envs, key=graphs)


def weigh(
    spec: StudySpec, trials: Sequence[FrozenTrial], pool: Sequence[SpecConfig], policy: Policy = DEFAULT_POLICY
) -> Weights:
    """Each candidate's probability that its launch or its deployment fails, and whether to keep
    it (by the study's `policy`: its memory model's grid and its bars)."""
    boundary = MemoryBoundary.fit(tuning_launches(spec, trials), policy)
    if boundary is None or not pool:
        return Weights(np.zeros(len(pool)), np.ones(len(pool), dtype=bool))
    tune = terms_for(lambda c: server_settings(spec, c), pool)
    dep = terms_for(lambda c: smallest_deployment(spec, c), pool)
    keep = boundary.p_fail(tune) < policy.probable_failure
    if envelope_fixed(spec):
        keep &= boundary.p_fail(dep) < policy.surely
    return Weights(boundary.p_fail_any(tune, dep), keep)
