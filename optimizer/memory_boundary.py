"""A learnt out-of-memory boundary, in the quantities the server allocates its CUDA graphs by.

`optimizer.infeasible` only skips configurations at least as large as one that failed in every
flag.  That misses the common case: after 4/8/33 ran out of memory, 3/8/25 is smaller in every
flag but still needs most of the memory that killed 4/8/33, when that memory went to topk 8's
draft graphs.  The server sizes its graph buffers by (docs/sglang.md §3, §13):

* x_v = draft tokens x captured batch (target verify and draft extend graphs);
* x_d = steps x topk x captured batch (draft decode graph; none with one step).

Memory needed on top of the fixed part is then about a*x_v + b*x_d with unknown a, b >= 0, and a
launch fails when that exceeds the unknown room s^-1.  Every successful launch bounds s from
above along each direction (a, b), every failure from below.  For each direction theta of a grid
over the quarter circle the consistent s form an interval; a candidate's probability of failing
is the share of (theta, log s) consistent with every launch so far under which it needs more
than the room.  Far beyond a failure in both quantities that is 1, inside the successes it is 0,
and in between it says how sure the data are.  With no failure yet there is no boundary (0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from optuna.trial import FrozenTrial, TrialState

from optimizer import attrs as A
from optimizer.infeasible import MEMORY_FAILURES
from optimizer.space import SpecConfig

FloatArray = NDArray[np.float64]

# Candidates at or above this probability of running out of memory are not launched.
PROBABLE_FAILURE = 0.5
_ANGLES = 61
# Without a success to bound it, the room is taken to lie within this factor of the failure.
_PRIOR_SPAN = 8.0


def quantities(configs: Sequence[SpecConfig], default_batch: int) -> tuple[FloatArray, FloatArray]:
    """(x_v, x_d) of each configuration; `default_batch` is the study's captured batch when untuned."""
    xv = np.empty(len(configs))
    xd = np.empty(len(configs))
    for i, cfg in enumerate(configs):
        c = cfg.canonical()
        b = float(c.cuda_graph_max_bs or default_batch)
        xv[i] = c.num_draft_tokens * b
        xd[i] = (c.num_steps * c.topk * b) if c.num_steps > 1 else 0.0
    return xv, xd


@dataclass(frozen=True)
class MemoryBoundary:
    """Consistent (direction, log room) intervals; see the module docstring."""

    directions: FloatArray  # (k, 2) unit vectors (a, b), only those some room fits
    log_lo: FloatArray  # (k,) log of the room's lower bound: the largest load that started
    log_hi: FloatArray  # (k,) log of its upper bound: the smallest load that ran out of memory
    default_batch: int
    failures: int

    @classmethod
    def fit(cls, trials: Sequence[FrozenTrial], default_batch: int) -> MemoryBoundary | None:
        """None when no launch ran out of memory, or the launches fit no such boundary."""
        ok: list[SpecConfig] = []
        bad: list[SpecConfig] = []
        for r in A.records(trials):
            if not r.has_config or not r.launched:
                continue
            if r.state == TrialState.COMPLETE and r.failure_kind in MEMORY_FAILURES:
                bad.append(r.config)
            elif r.state in (TrialState.COMPLETE, TrialState.PRUNED) and r.has_levels:
                ok.append(r.config)
        if not bad:
            return None
        theta = np.linspace(0.0, math.pi / 2, _ANGLES)
        u = np.stack([np.cos(theta), np.sin(theta)], axis=1)
        fv, fd = quantities(bad, default_batch)
        # Along direction u the load of x is u.x; the room R satisfies u.x > R for every failure
        # and u.x <= R for every success.
        fail_load = u @ np.stack([fv, fd])  # (k, n_bad)
        lo = np.log(np.maximum(fail_load.min(axis=1), 1e-12))  # R < min failure load
        if ok:
            sv, sd = quantities(ok, default_batch)
            ok_load = u @ np.stack([sv, sd])
            hi_r = np.log(np.maximum(ok_load.max(axis=1), 1e-12))  # R >= max success load
        else:
            hi_r = lo - math.log(_PRIOR_SPAN)
        # Consistent room: log R in [hi_r, lo) per direction.
        keep = hi_r < lo
        if not keep.any():
            return None
        return cls(u[keep], hi_r[keep], lo[keep], default_batch, len(bad))

    def p_fail(self, configs: Sequence[SpecConfig]) -> FloatArray:
        """Probability that each configuration runs out of memory (0 where no data say so)."""
        xv, xd = quantities(configs, self.default_batch)
        load = self.directions @ np.stack([xv, xd])  # (k, n)
        log_load = np.log(np.maximum(load, 1e-12))
        lo_r, hi_r = self.log_lo[:, None], self.log_hi[:, None]
        # Fails when its load exceeds the room R, R log-uniform in [lo_r, hi_r).
        share = np.clip((log_load - lo_r) / np.maximum(hi_r - lo_r, 1e-9), 0.0, 1.0)
        out: FloatArray = share.mean(axis=0)
        return out


def default_batch_of(concurrency: Sequence[int]) -> int:
    """The captured batch of an untuned study's servers (optimizer.plan: the largest level)."""
    return max(concurrency)
