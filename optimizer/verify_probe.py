"""The verify cost's shape, from a baseline's verify probe (issue 31 item 2).

The worker times extends of a cached prefix on the baseline server (workers/loadgen/probe.py):
at each level b of the objective, b requests extend the prefix by k new tokens at once, one
forward over b x k tokens, which is what a verify of k draft tokens at batch b computes.  This
module turns those times into the cost of a verify relative to the host's own decode step at the
same batch, the unit the performance model states its costs in (optimizer/perf_model.py's r_b):

    shape(b, k) = (t(b, k) - o_b) / s_b,    o_b = max(0, t(b, 1) - s_b)

where t(b, k) is the probe's median time, s_b the baseline's decode step at level b (b / its
output tok/s: one step emits b tokens) and o_b the constant part of a probe call that is no
forward (HTTP, the scheduler's step, an eager launch where the decode ran a CUDA graph).  So
shape(b, 1) = 1 and shape(b, k) is phi(b k) / phi(b) in perf_model's notation, measured, with
whatever form the engine has: tile steps, knees, expert saturation.  A shape never falls with k
(more tokens never compute less; a dip is timing noise): each count keeps the largest value
seen at or below it.  Without the baseline's decode step the overhead cannot be told apart and
the ratios are those of the raw times (biased towards 1 by the overhead).

How the model uses it (optimizer/perf_model.py `fit`'s `shapes`; the second is not done yet):

* as data for the cost half before the first speculative launch: a residual per probe point,
  (log phi(b k) / phi(b) - log shape(b, k)) / sd(b, k), next to the trials' cycle ratios, so
  beta, the knee and beta' start from this host's own forward instead of the published ranges;
* where the parametric phi cannot hold the shape (a tile step leaves residuals beyond their sd),
  as the verify term itself: r_b = steps delta (1 + gamma (topk - 1)) + shape.ratio(b, n) + omega / phi(b),
  fitting only the draft and overhead terms on the trials.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

# The numbers of tokens a verify step can carry per request (SGLang's draft trees hold up to 64).
PROBE_TOKENS = (1, 2, 4, 8, 16, 32, 64)
# A batch above this many new tokens would be chunked by the engine (SGLang's default chunked
# prefill size is 2048-16384 depending on the GPU); such counts are skipped, and noted.
MAX_BATCH_TOKENS = 2048
# The prefix the extends attend to: a verify runs at a request's context, a few hundred tokens
# into a chat reply; kept short so the probe stays cheap.
DEFAULT_PREFIX_TOKENS = 256


@dataclass(frozen=True)
class ProbePlan:
    """What to probe: the objective's levels, the token counts, the repeats and the bounds."""

    levels: tuple[int, ...]
    tokens: tuple[int, ...] = PROBE_TOKENS
    repeats: int = 3
    prefix_tokens: int = DEFAULT_PREFIX_TOKENS
    max_batch_tokens: int = MAX_BATCH_TOKENS
    budget_s: float = 120.0
    request_timeout_s: float = 60.0

    def batches(self) -> list[tuple[int, int]]:
        """(concurrency, tokens) pairs within `max_batch_tokens`, levels in order, counts rising."""
        return [(b, k) for b in self.levels for k in sorted(set(self.tokens)) if b * k <= self.max_batch_tokens]


def probe_levels(levels: Sequence[int], max_running_requests: int | None) -> tuple[int, ...]:
    """The objective's levels as the server runs them: capped at its max running requests."""
    cap = max_running_requests or max(levels)
    return tuple(sorted({min(c, cap) for c in levels}))


# The relative sd given a point measured once (no spread to read): a few % per call, the loadgen's
# timing noise on a quiet host.
SINGLE_RUN_SD = 0.03


@dataclass(frozen=True)
class ShapePoint:
    tokens: int  # new tokens per request (a verify's draft tokens)
    ratio: float  # cost relative to the decode step at the same batch
    sd: float  # standard deviation of `ratio`


@dataclass(frozen=True)
class VerifyShape:
    """The verify cost relative to the decode step, per batch (the levels the probe ran)."""

    points: Mapping[int, tuple[ShapePoint, ...]]  # batch -> points, tokens rising
    overhead_s: Mapping[int, float]  # o_b removed from every time at that batch
    decode_s: Mapping[int, float]  # s_b (the probe's own k=1 time where the baseline gives none)

    def ratio(self, batch: int, tokens: float) -> float | None:
        """shape(batch, tokens), linear between probed counts and along the last slope beyond the
        largest; None for a batch the probe did not run, or ran at one count only (the model keeps
        its own prior there)."""
        pts = self.points.get(batch)
        if not pts:
            return None
        if tokens <= pts[0].tokens:
            return pts[0].ratio
        if len(pts) == 1:
            return None  # one count says nothing about the slope
        for lo, hi in zip(pts, pts[1:], strict=False):
            if tokens <= hi.tokens:
                return lo.ratio + (hi.ratio - lo.ratio) * (tokens - lo.tokens) / (hi.tokens - lo.tokens)
        lo, hi = pts[-2], pts[-1]
        return hi.ratio + (hi.ratio - lo.ratio) * (tokens - hi.tokens) / (hi.tokens - lo.tokens)


def decode_steps(levels: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """The decode step in seconds per level of a baseline's reported levels: b / output tok/s."""
    out: dict[int, float] = {}
    for lv in levels:
        c, tok_s = lv.get("concurrency"), lv.get("output_tok_s")
        if isinstance(c, int) and isinstance(tok_s, int | float) and tok_s > 0:
            out[c] = c / float(tok_s)
    return out


def verify_shape(probe: Mapping[str, Any], levels: Iterable[Mapping[str, Any]] = ()) -> VerifyShape | None:
    """The shape of a stored probe (`Metrics.verify_probe` as JSON) against its baseline's levels;
    None when the probe has no k=1 point at any batch (nothing to be relative to)."""
    decode = decode_steps(levels)
    by_batch: dict[int, dict[int, list[float]]] = {}
    for p in probe.get("points") or []:
        runs = [float(x) for x in p.get("seconds_runs") or []] or [float(p["seconds"])]
        by_batch.setdefault(int(p["concurrency"]), {})[int(p["tokens"])] = runs
    points: dict[int, tuple[ShapePoint, ...]] = {}
    overhead: dict[int, float] = {}
    steps: dict[int, float] = {}
    for b, counts in sorted(by_batch.items()):
        if 1 not in counts:
            continue
        one = statistics.median(counts[1])
        s_b = decode.get(b)
        o_b = 0.0 if s_b is None else max(0.0, one - s_b)
        unit = one - o_b  # s_b where the baseline gives it (and the probe's k=1 time is above it)
        if unit <= 0:
            continue
        shape: list[ShapePoint] = []
        for k in sorted(counts):
            runs = counts[k]
            t = statistics.median(runs)
            sd = statistics.stdev(runs) / math.sqrt(len(runs)) if len(runs) > 1 else SINGLE_RUN_SD * t
            ratio = max((t - o_b) / unit, shape[-1].ratio if shape else 0.0)
            shape.append(ShapePoint(k, ratio, sd / unit))
        points[b], overhead[b], steps[b] = tuple(shape), o_b, unit
    if not points:
        return None
    return VerifyShape(points=points, overhead_s=overhead, decode_s=steps)


class ProbedBaseline(Protocol):
    """A baseline as the conductor holds it (optimizer.conductor.Baseline), as far as its probe goes."""

    @property
    def worker_id(self) -> str: ...
    @property
    def measured_at(self) -> datetime: ...
    @property
    def levels(self) -> Sequence[Mapping[str, Any]]: ...
    @property
    def valid(self) -> bool: ...
    @property
    def verify_probe(self) -> Mapping[str, Any] | None: ...


def latest_shapes(baselines: Iterable[ProbedBaseline]) -> dict[str, VerifyShape]:
    """Per host, the shape of its newest probe (of its newest valid baseline that carries one, against
    that baseline's own levels).  A host's baselines under a previous token (`valid` False) are not
    its own; a probe that yields no shape leaves the host out.  What the conductor's Snapshot hands
    every fit of the study (`Snapshot.verify_shapes`), and the study document's winner alike."""
    newest: dict[str, ProbedBaseline] = {}
    for b in baselines:
        if not b.valid or not b.verify_probe:
            continue
        held = newest.get(b.worker_id)
        if held is None or b.measured_at >= held.measured_at:
            newest[b.worker_id] = b
    out: dict[str, VerifyShape] = {}
    for host, b in sorted(newest.items()):
        assert b.verify_probe is not None
        shape = verify_shape(b.verify_probe, b.levels)
        if shape is not None:
            out[host] = shape
    return out


def shapes_key(shapes: Mapping[str, VerifyShape] | None) -> str:
    """The shapes as a memo key: two fits of the same trials with different probes differ."""
    if not shapes:
        return ""
    return repr(
        [
            (host, [(b, [(p.tokens, p.ratio, p.sd) for p in pts]) for b, pts in sorted(s.points.items())])
            for host, s in sorted(shapes.items())
        ]
    )
