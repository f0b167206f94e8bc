"""Infeasible regions learnt from failures: never launch what is known to run out of memory.

GPU memory at start-up grows monotonically with each of draft tokens, topk, steps and the largest
captured batch (the graphs' buffers are sized by draft tokens x batch, the draft decode graph by
topk x steps x batch; docs/sglang.md §13, docs/calibration.md §6.5).  So when a point ran out of
memory, every point at least as large in all four needs at least as much and will fail too: it
is told as infeasible without a launch, with `inferred_from` naming the trial that failed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from optuna.trial import FrozenTrial, TrialState

from optimizer import attrs as A
from optimizer.space import SpecConfig

# Failure kinds that say "this much memory does not fit".
MEMORY_FAILURES = frozenset({"oom"})


@dataclass(frozen=True)
class OomPoint:
    trial_number: int
    config: SpecConfig


def needs_at_least(candidate: SpecConfig, failed: SpecConfig) -> bool:
    """True when `candidate` needs at least as much GPU memory as `failed` (componentwise).

    An unset graph size means "the study's default", the same for both when neither tunes it.
    """
    c, f = candidate.canonical(), failed.canonical()
    if c.cuda_graph_max_bs is None or f.cuda_graph_max_bs is None:
        if c.cuda_graph_max_bs != f.cuda_graph_max_bs:
            return False
    elif c.cuda_graph_max_bs < f.cuda_graph_max_bs:
        return False
    return c.num_draft_tokens >= f.num_draft_tokens and c.topk >= f.topk and c.num_steps >= f.num_steps


def oom_points(trials: Iterable[FrozenTrial]) -> list[OomPoint]:
    """Configurations that ran out of memory in these trials (measured failures, not inferred ones)."""
    out = []
    for r in A.records(trials):
        if r.state != TrialState.COMPLETE or r.failure_kind not in MEMORY_FAILURES:
            continue
        if r.has(A.INFERRED_FROM) or not r.has_config:
            continue
        out.append(OomPoint(r.number, r.config))
    return out


def known_to_fail(config: SpecConfig, points: Sequence[OomPoint]) -> OomPoint | None:
    """The failed point that proves `config` would run out of memory too, if any."""
    for p in points:
        if needs_at_least(config, p.config):
            return p
    return None
