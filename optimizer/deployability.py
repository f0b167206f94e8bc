"""How likely a search candidate is to be worth its launch: it starts, and its answer can be deployed.

A trial runs in the tuning envelope (optimizer.plan); the answer is deployed in the printed one
(optimizer.deploy), or, where the serving section leaves the graphs to us, in the smallest graph
envelope a confirmation may fall back to.  Both are judged by one memory model in the
deployment's terms (optimizer.memory_boundary), learnt from every launch of the search, so a
start in the small tuning envelope counts for the deployment only as far as the terms say.

`weigh` gives the sampler (optimizer.model_sampler) each candidate's probability that its launch
or its deployment runs out of memory (the acquisition is multiplied by one minus it), and drops
candidates that probably fail to start (PROBABLE_FAILURE), and, where the serving section fixes
the deployed graphs (`serving.max_batch`: no smaller envelope to fall back to), those the model
says surely fail to deploy (SURELY).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from optuna.trial import FrozenTrial

from optimizer.deploy import deployment_envelopes
from optimizer.memory_boundary import (
    PROBABLE_FAILURE,
    SURELY,
    FloatArray,
    Judgement,
    MemoryBoundary,
    Terms,
    capture_list,
    judge,
    terms_for,
    tuning_launches,
)
from optimizer.plan import server_settings
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


def weigh(spec: StudySpec, trials: Sequence[FrozenTrial], pool: Sequence[SpecConfig]) -> Weights:
    """Each candidate's probability that its launch or its deployment fails, and whether to keep it."""
    boundary = MemoryBoundary.fit(tuning_launches(spec, trials))
    if boundary is None or not pool:
        return Weights(np.zeros(len(pool)), np.ones(len(pool), dtype=bool))
    tune = terms_for(lambda c: server_settings(spec, c), pool)
    dep = terms_for(lambda c: smallest_deployment(spec, c), pool)
    keep = boundary.p_fail(tune) < PROBABLE_FAILURE
    if envelope_fixed(spec):
        keep &= boundary.p_fail(dep) < SURELY
    return Weights(boundary.p_fail_any(tune, dep), keep)


def deployment_judgement(spec: StudySpec, trials: Sequence[FrozenTrial], config: SpecConfig) -> Judgement:
    """Why `config`'s least demanding deployment is judged as likely to fail as it is."""
    return judge(MemoryBoundary.fit(tuning_launches(spec, trials)), Terms.of(smallest_deployment(spec, config), config))
