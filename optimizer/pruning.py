"""Stop a trial early when its first levels already show it cannot win, beyond the noise seen.

The worker reports each concurrency level as it finishes it (`POST /progress`).  After each, the
trial's best possible objective is bounded from above: the levels measured count as measured,
and every level still to come is assumed as good as the best any trial reached there.  When even
that bound, widened by the noise seen so far, is below the best measured objective, the rest of
the benchmark cannot change the answer and is skipped.

Noise: the relative spread of the repeated passes (output_tok_s_runs) of the trials and
baselines measured so far; a ratio of two means of R passes then has a relative sd of about
cv * sqrt(2/R).  `Z_PRUNE` standard deviations, and never less than `MIN_MARGIN`, keep pruning
to "clearly worse".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial

from optimizer import attrs as A
from optimizer.policy import DEFAULT_POLICY
from optimizer.spec import StudySpec

Z_PRUNE = DEFAULT_POLICY.z_prune  # optimizer.policy
MIN_MARGIN = DEFAULT_POLICY.min_margin  # optimizer.policy


@dataclass(frozen=True)
class PruneDecision:
    prune: bool
    bound: float | None  # the optimistic objective of this trial
    best: float | None  # the best measured objective
    margin: float  # relative noise margin used
    reason: str


def run_spread(levels: Iterable[Mapping[str, Any]]) -> list[float]:
    """Coefficients of variation of each level's repeated passes (levels with >= 2 passes)."""
    out = []
    for lv in levels:
        runs = [float(x) for x in lv.get("output_tok_s_runs") or []]
        if len(runs) >= 2 and statistics.fmean(runs) > 0:
            out.append(statistics.stdev(runs) / statistics.fmean(runs))
    return out


def noise_margin(trials: Sequence[FrozenTrial], repeats: int) -> float:
    cvs: list[float] = []
    for r in A.records(trials):
        cvs += run_spread(r.levels)
        cvs += run_spread(r.baseline_levels)
    if not cvs:
        return MIN_MARGIN
    cv = math.sqrt(statistics.fmean(c * c for c in cvs))
    return max(MIN_MARGIN, Z_PRUNE * cv * math.sqrt(2.0 / max(1, repeats)))


def decide(spec: StudySpec, trials: Sequence[FrozenTrial], partial: Mapping[int, float]) -> PruneDecision:
    """Should a trial with these measured per-level speedups stop now?"""
    measured = A.measured_feasible(trials, A.SPEEDUP_BY_LEVEL)
    margin = noise_margin(measured, spec.workload.repeats)
    if spec.sampler == "list":
        return PruneDecision(False, None, None, margin, "a benchmark of given configurations measures every level")
    if not measured:
        return PruneDecision(False, None, None, margin, "nothing measured yet to compare with")
    best = max(float(t.value) for t in measured if t.value is not None)
    if spec.objective.concurrency is not None:
        levels = [spec.objective.concurrency]
    else:
        levels = list(spec.workload.concurrency)
    logs = []
    for level in levels:
        if level in partial:
            v = partial[level]
        else:
            seen = [A.TrialRecord(t).speedup_at(level) or 0.0 for t in measured]
            v = max(seen) if seen else math.inf
        if v <= 0:
            v = 1e-9
        logs.append(math.log(v))
    bound = math.exp(statistics.fmean(logs))
    if math.isinf(bound):
        return PruneDecision(False, None, best, margin, "a level still to come has no measurement to bound it")
    widened = bound * (1.0 + margin)
    if widened < best:
        return PruneDecision(
            True,
            bound,
            best,
            margin,
            f"at best {bound:.3f}x even if the remaining levels match the best seen, "
            f"below the best {best:.3f}x by more than the noise ({100 * margin:.1f}%)",
        )
    return PruneDecision(False, bound, best, margin, "could still reach the best")
