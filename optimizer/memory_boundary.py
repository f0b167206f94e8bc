"""A learnt out-of-memory boundary in the deployment's terms: what a server's CUDA graphs need.

A trial's server (the tuning envelope: graphs only for the measured batch sizes) and the deployed
one (the printed envelope: graphs up to serving's max running requests) allocate graph memory by
the same rule (docs/sglang.md §3, §13), per GPU, on top of weights and KV pool:

* n   = the number of captured batch sizes (each adds a fixed part to every graph family);
* x_v = draft tokens x the largest captured batch (target verify and draft extend graphs);
* x_d = steps x topk x the largest captured batch (draft decode graph; none with one step).

The largest captured batch is the capture list's, cut at max running requests (as SGLang cuts it).
A server runs out of memory when a*x_v + b*x_d + k*n exceeds the unknown room R left for graphs,
with unknown a, b, k >= 0.  So a launch in one envelope is evidence about another only through
these terms: a start with graphs for batch 16 bounds R from above in batch-16 units, and says
nothing certain about batch 48 with 23 captured sizes unless the terms already exceed a failure.

The model is a grid of hypotheses: a direction (a, b) on the quarter circle and the share kappa
of the room each captured size costs (the policy's `kappas`), so a launch's normalised load is
(a*x_v + b*x_d) / (1 - kappa*n) (infinite when the sizes alone fill the room).  Every start
bounds R from above, every out-of-memory launch from below; a hypothesis none of the room fits
is dropped.  A candidate's probability of failing is the mean over the directions left, and
within a direction over the per-size shares weighted by the width of their consistent room
interval, of where its load falls in that interval (log-uniform): 1 beyond a failure in every term,
0 inside a start in every term, and in between it says how sure the data are.  With no failure
yet there is no boundary (0).  Monotone: more of any term never lowers it.

Launches at other memory settings (mem fraction, max running requests, TP, context length) would
have another room: the model is fit on one study's launches, whose tuning and deployed servers
share them (optimizer.plan, optimizer.deploy).  An out-of-memory failure of the KV cache pool says
nothing about the graph terms and is not used either.  With every launch in one envelope the
model is the direction-only boundary spectune used before (kappa cancels out).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from optuna.trial import FrozenTrial, TrialState

from optimizer import attrs as A
from optimizer.infeasible import MEMORY_FAILURES
from optimizer.plan import server_settings
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec

FloatArray = NDArray[np.float64]

# The bars the callers judge by are the study's policy (optimizer.policy): `probable_failure`
# (a candidate at or above it in the tuning envelope is not launched) and `surely` (a deployment
# that likely to run out of memory is "sure to fail": not proposed where the serving envelope is
# fixed, not launched first in a confirmation where a smaller one is allowed); so are the shares
# of the graph room each captured size may cost (`kappas`, 0: sizes are free) and the room's
# span without a start to bound it (`prior_span`), which `MemoryBoundary.fit` takes.
_ANGLES = 61
# Loads closer than this (in log) are one load: a start and a failure there contradict.
_TIE = 1e-9
# A consistent room interval wider than this factor counts as this wide (one unbounded above).
_MAX_SPAN = 1000.0

# SGLang's capture list with speculation (docs/sglang.md §3): 1-8, 10-32 by 2, 40-64 by 4,
# 72-256 by 8, then by 16.
_SPEC_SIZES = (*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, 4097, 16))


def capture_list(settings: ServerSettings) -> tuple[int, ...]:
    """The batch sizes this speculative server captures, cut at max running requests."""
    running = settings.max_running_requests
    if settings.cuda_graph_bs:
        sizes = sorted(set(settings.cuda_graph_bs))
    else:
        # Unset: SGLang's default by GPU memory, lowered to max running requests; taken as the latter.
        top = settings.cuda_graph_max_bs or running
        sizes = [s for s in _SPEC_SIZES if s <= top]
        if not sizes or sizes[-1] != top:
            sizes.append(top)
    cut = [s for s in sizes if s <= running]
    return tuple(cut) if cut else (min(sizes[0], running),)


@dataclass(frozen=True)
class Terms:
    """What one server's graphs need memory for (see the module docstring)."""

    sizes: int
    batch: int  # the largest captured batch
    draft_tokens: int
    draft_width: int  # steps x topk; 0 with one step (no draft decode graph)

    @classmethod
    def of(cls, settings: ServerSettings, config: SpecConfig | None = None) -> Terms:
        """The terms of `settings` running `config` (default: the settings' own configuration)."""
        cfg = config or settings.speculative
        assert cfg is not None, "only a speculative server has draft graphs"
        return cls.each(settings, [cfg])[0]

    @classmethod
    def each(cls, settings: ServerSettings, configs: Sequence[SpecConfig]) -> list[Terms]:
        """`of` for many configurations on one envelope (the capture list resolved once)."""
        sizes = capture_list(settings)
        out = []
        for cfg in configs:
            c = cfg.canonical()
            out.append(cls(len(sizes), sizes[-1], c.num_draft_tokens, c.num_steps * c.topk if c.num_steps > 1 else 0))
        return out

    @property
    def xv(self) -> float:
        return float(self.batch * self.draft_tokens)

    @property
    def xd(self) -> float:
        return float(self.batch * self.draft_width)

    def covers(self, other: Terms) -> bool:
        """Needs at least as much graph memory as `other`, whatever a, b, k are."""
        return self.sizes >= other.sizes and self.xv >= other.xv and self.xd >= other.xd

    def describe(self) -> str:
        return (
            f"{self.sizes} captured size{'s' if self.sizes != 1 else ''} up to batch {self.batch}, "
            f"{self.draft_tokens} draft tokens, steps x topk {self.draft_width or 1}"
        )


@dataclass(frozen=True)
class Launch:
    """One server start: its terms, whether it started, and who it was (for the reasons given)."""

    terms: Terms
    started: bool
    source: str  # "trial 7 (tuning envelope)", "the deployment of 3/2/10 (graphs up to 48)"


@dataclass(frozen=True)
class Judgement:
    p_fail: float
    reason: str


def _loads(u: FloatArray, kappa: FloatArray, n: FloatArray, xv: FloatArray, xd: FloatArray) -> FloatArray:
    """Normalised load (hypotheses x launches): (a*x_v + b*x_d) / (1 - kappa*n), inf past the room."""
    lin = u[:, :1] * xv[None, :] + u[:, 1:] * xd[None, :]
    left = 1.0 - kappa[:, None] * n[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        out: FloatArray = np.where(left > 0, lin / np.maximum(left, 1e-12), np.inf)
    return out


def _arrays(terms: Sequence[Terms]) -> tuple[FloatArray, FloatArray, FloatArray]:
    return (
        np.array([t.sizes for t in terms], dtype=float),
        np.array([t.xv for t in terms], dtype=float),
        np.array([t.xd for t in terms], dtype=float),
    )


@dataclass(frozen=True)
class MemoryBoundary:
    """Consistent (hypothesis, log room) intervals; see the module docstring."""

    u: FloatArray  # (h, 2) directions (a, b) of the hypotheses left
    kappa: FloatArray  # (h,) their per-size share of the room
    log_lo: FloatArray  # (h,) log of the room's lower bound: the largest load that started
    log_hi: FloatArray  # (h,) log of its upper bound: the smallest load that ran out of memory
    weight: FloatArray  # (h,) each hypothesis' share of the belief (sums to 1)
    launches: tuple[Launch, ...]

    @property
    def failures(self) -> int:
        return sum(not x.started for x in self.launches)

    @classmethod
    def fit(cls, launches: Sequence[Launch], policy: Policy = DEFAULT_POLICY) -> MemoryBoundary | None:
        """None when no launch ran out of memory, or the launches fit no such boundary.  `policy`:
        the study's (the per-size shares `kappas`, and `prior_span`: without a start to bound it,
        the room is taken to lie within this factor of the failure)."""
        kappas = policy.kappas
        bad = [x for x in launches if not x.started]
        ok = [x for x in launches if x.started]
        if not bad:
            return None
        theta = np.linspace(0.0, math.pi / 2, _ANGLES)
        dirs = np.stack([np.cos(theta), np.sin(theta)], axis=1)
        u = np.repeat(dirs, len(kappas), axis=0)
        kappa = np.tile(np.array(kappas, dtype=float), _ANGLES)
        fail = _loads(u, kappa, *_arrays([x.terms for x in bad])).min(axis=1)
        with np.errstate(divide="ignore"):
            hi = np.log(np.maximum(fail, 1e-12))  # R < the smallest failing load
            if ok:
                lo = np.log(np.maximum(_loads(u, kappa, *_arrays([x.terms for x in ok])).max(axis=1), 1e-12))
            else:
                lo = hi - math.log(policy.prior_span)
        # Consistent room: log R in [lo, hi); a start past the room (inf) rules the hypothesis out.
        keep = np.isfinite(lo) & (lo < hi - _TIE)
        if not keep.any():
            return None
        # Within a direction, a per-size share counts by how much room it leaves consistent with
        # the launches (a uniform prior on log R): a share that explains an out-of-memory deployment
        # only by a hair weighs little.  Every direction left counts the same, so with all launches
        # in one envelope (the shares' intervals then equal) this is the plain direction boundary.
        width = np.where(keep, np.minimum(hi - lo, math.log(_MAX_SPAN)), 0.0)
        per_dir = width.reshape(_ANGLES, len(kappas))
        totals = per_dir.sum(axis=1, keepdims=True)
        w = np.where(totals > 0, per_dir / np.where(totals > 0, totals, 1.0), 0.0).ravel()
        w = w / w.sum()
        return cls(u[keep], kappa[keep], lo[keep], hi[keep], w[keep], tuple(launches))

    def _shares(self, terms: Sequence[Terms]) -> FloatArray:
        """(hypotheses x candidates) probability of failing under each hypothesis."""
        load = _loads(self.u, self.kappa, *_arrays(terms))
        with np.errstate(divide="ignore"):
            log_load = np.log(np.maximum(load, 1e-12))
        lo, hi = self.log_lo[:, None], self.log_hi[:, None]
        finite = np.isfinite(hi)
        span = np.where(finite, hi - lo, 1.0)
        share = np.clip((log_load - lo) / span, 0.0, 1.0)
        # Failures that the sizes alone explain leave R unbounded above: only an infinite load fails.
        out: FloatArray = np.where(finite, share, np.isinf(load).astype(float))
        return out

    def p_fail(self, terms: Sequence[Terms]) -> FloatArray:
        """Probability that each server runs out of memory at graph capture."""
        if not terms:
            return np.zeros(0)
        out: FloatArray = self.weight @ self._shares(terms)
        return out

    def p_fail_any(self, first: Sequence[Terms], second: Sequence[Terms]) -> FloatArray:
        """Probability that a pair of servers (e.g. a trial and its deployment) does not both start."""
        if not first:
            return np.zeros(0)
        out: FloatArray = self.weight @ np.maximum(self._shares(first), self._shares(second))
        return out

    def judge(self, terms: Terms) -> Judgement:
        """The probability of failing, with the launch that decides it named where one does."""
        p = float(self.p_fail([terms])[0])
        beaten = next((x for x in self.launches if not x.started and terms.covers(x.terms)), None)
        if beaten is not None:
            return Judgement(p, f"needs at least the graph memory of {beaten.source}, which ran out of memory")
        under = next((x for x in self.launches if x.started and x.terms.covers(terms)), None)
        if under is not None:
            return Judgement(p, f"needs no more graph memory than {under.source}, which started")
        starts = len(self.launches) - self.failures
        near = min((x for x in self.launches if not x.started), key=lambda x: _distance(x.terms, terms))
        return Judgement(
            p,
            f"{p:.0%} of the memory boundaries consistent with {starts} start(s) and {self.failures} "
            f"out-of-memory launch(es) (the nearest: {near.source}) put {terms.describe()} past the room",
        )


def _distance(a: Terms, b: Terms) -> float:
    """How far apart two servers' graph terms are (log ratios), to name the nearest failure."""
    return sum(abs(math.log((x + 1.0) / (y + 1.0))) for x, y in ((a.sizes, b.sizes), (a.xv, b.xv), (a.xd, b.xd)))


def judge(boundary: MemoryBoundary | None, terms: Terms) -> Judgement:
    """`MemoryBoundary.judge`, or 0 with the reason when nothing ran out of memory yet."""
    if boundary is None:
        return Judgement(0.0, "no launch at these memory settings has run out of memory")
    return boundary.judge(terms)


def kv_pool_failure(message: str | None) -> bool:
    """An out-of-memory start that failed allocating the KV cache pool, not a graph."""
    text = (message or "").lower()
    return ("kv" in text or "memory pool" in text) and "graph" not in text and "capture" not in text


def tuning_launches(spec: StudySpec, trials: Sequence[FrozenTrial]) -> list[Launch]:
    """The search's launches, each in the server it ran (optimizer.plan: the tuning envelope)."""
    out = []
    for r in A.records(trials):
        if not r.has_config or not r.launched:
            continue
        if r.state == TrialState.COMPLETE and r.failure_kind in MEMORY_FAILURES:
            if kv_pool_failure(r.failure_message):
                continue
            started = False
        elif r.state in (TrialState.COMPLETE, TrialState.PRUNED) and r.has_levels:
            started = True
        else:
            continue
        settings = server_settings(spec, r.config)
        c = r.config.canonical()
        out.append(
            Launch(Terms.of(settings), started, f"{c.num_steps}/{c.topk}/{c.num_draft_tokens} (trial {r.number})")
        )
    return out


def terms_for(settings_of: Callable[[SpecConfig], ServerSettings], configs: Sequence[SpecConfig]) -> list[Terms]:
    """Each configuration's terms on the server `settings_of` gives it, resolved once per graph size
    tuned (the only part of a configuration the envelope depends on)."""
    groups: dict[int | None, list[int]] = {}
    for i, c in enumerate(configs):
        groups.setdefault(c.cuda_graph_max_bs, []).append(i)
    out: list[Terms | None] = [None] * len(configs)
    for idx in groups.values():
        settings = settings_of(configs[idx[0]])
        for i, t in zip(idx, Terms.each(settings, [configs[i] for i in idx]), strict=True):
            out[i] = t
    return [t for t in out if t is not None]
