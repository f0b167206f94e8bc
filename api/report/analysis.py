"""What the report plots, computed from a study's trials (`/v1/studies/{name}/trials`, as `TrialRow`s).

Speculative decoding, per request: tokens per cycle = accept length (AL); cycle time ≈ draft
steps × draft cost + verify cost(draft tokens) + overhead; throughput = AL / cycle time.  So for
each measured trial at the level of interest:

* per-token accept rate = (AL − 1) / (draft tokens − 1): the share of drafted tokens accepted
  (the bonus token excluded), the number that tells whether deeper drafts still pay;
* cycle time = AL / per-user tok/s (seconds per verify cycle of one request);
* the split of the cycle into draft and verify parts comes from a least-squares fit over the
  trials, cycle = a + b·steps + c·draft_tokens: b·steps is the draft part, a + c·draft_tokens
  the verify part (with fixed overhead).  It is an estimate: the fit assumes each draft step
  costs the same and verify grows linearly with the tree size, and needs at least four trials
  spanning steps and draft tokens; otherwise the report shows the measured cycle only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from api.documents import LevelAnswer, StudyDocument, TrialRow

MIN_FIT_TRIALS = 4


@dataclass(frozen=True)
class Point:
    """One measured configuration at one concurrency level (`level`).

    `speedup` is the speedup measured at that level (a failed configuration's is the placeholder
    value Optuna was told); `objective` is the study's objective value (that level, or the
    geometric mean over levels), which is what the search ranks by.  A pruned trial was stopped
    after some levels: its point exists where it measured the level.
    """

    number: int
    steps: int
    topk: int
    draft_tokens: int
    speedup: float
    feasible: bool
    accept_length: float | None
    per_user_tok_s: float | None
    startup_s: float | None
    speedup_by_level: dict[int, float]
    level: int = 0
    objective: float | None = None
    pruned: bool = False

    @property
    def label(self) -> str:
        return f"{self.steps}/{self.topk}/{self.draft_tokens}"

    @property
    def accept_rate(self) -> float | None:
        if self.accept_length is None or self.draft_tokens <= 1:
            return None
        return (self.accept_length - 1.0) / (self.draft_tokens - 1.0)

    @property
    def cycle_ms(self) -> float | None:
        if self.accept_length is None or not self.per_user_tok_s:
            return None
        return 1000.0 * self.accept_length / self.per_user_tok_s


@dataclass(frozen=True)
class CycleFit:
    """cycle_ms ≈ overhead_ms + draft_step_ms·steps + verify_token_ms·draft_tokens."""

    overhead_ms: float
    draft_step_ms: float
    verify_token_ms: float
    r2: float
    n: int

    def draft_ms(self, p: Point) -> float:
        return self.draft_step_ms * p.steps

    def verify_ms(self, p: Point) -> float:
        return self.overhead_ms + self.verify_token_ms * p.draft_tokens


def level_of_interest(shown: StudyDocument) -> int:
    """The objective's concurrency, or the lowest measured one for a geometric-mean objective."""
    spec = shown.spec
    return spec.objective.concurrency or min(spec.workload.concurrency)


def points(trials: Sequence[TrialRow], level: int) -> list[Point]:
    """Every configuration launched and measured at `level` (duplicates answered from another trial skipped).

    Completed trials (measured, or failed with a placeholder value) and pruned trials that measured
    this level before they were stopped.
    """
    out = []
    for t in trials:
        config = t.config
        if config is None or t.duplicate_of is not None:
            continue
        pruned = t.state == "PRUNED"
        if pruned:
            by_level = t.partial_speedup_by_level or {}
        elif t.state == "COMPLETE" and t.speedup is not None:
            by_level = t.speedup_by_level or {}
        else:
            continue
        by_level_f = {int(k): float(v) for k, v in by_level.items()}
        failed = bool(t.failure_kind) or not t.feasible
        if level in by_level_f:
            value = by_level_f[level]
        elif failed and not pruned and t.speedup is not None:
            value = t.speedup  # the placeholder told to Optuna: no level was measured
        else:
            continue
        at = next((lv for lv in t.levels or [] if lv.concurrency == level), None)
        out.append(
            Point(
                number=t.number,
                steps=config.num_steps,
                topk=config.topk,
                draft_tokens=config.num_draft_tokens,
                speedup=value,
                feasible=not failed,
                accept_length=None if at is None else at.accept_length,
                per_user_tok_s=None if at is None else at.per_user_tok_s,
                startup_s=t.startup_s,
                speedup_by_level=by_level_f,
                level=level,
                objective=None if pruned else t.speedup,
                pruned=pruned,
            )
        )
    return out


def pruned_before(trials: Sequence[TrialRow], level: int) -> int:
    """Pruned trials stopped before they measured `level` (not drawn at that level)."""
    return sum(
        1
        for t in trials
        if t.state == "PRUNED" and t.duplicate_of is None and str(level) not in (t.partial_speedup_by_level or {})
    )


def best_by_level_text(best: Mapping[str, LevelAnswer]) -> str | None:
    """What the study's own data (its `best_by_level`) say about the best configuration per level, in one sentence."""
    if len(best) < 2:
        return None
    parts = []
    for level, a in sorted(best.items(), key=lambda kv: int(kv[0])):
        c = a.config
        parts.append(f"at concurrency {level}: {c.num_steps}/{c.topk}/{c.num_draft_tokens} ({a.speedup:.3f}x)")
    configs = {(a.config.num_steps, a.config.topk, a.config.num_draft_tokens) for a in best.values()}
    lead = (
        "The best configuration is the same at every level"
        if len(configs) == 1
        else "The best configuration differs by level"
    )
    return f"{lead}: " + "; ".join(parts) + "."


def fit_cycle(pts: list[Point]) -> CycleFit | None:
    """Least squares of cycle time on (1, steps, draft tokens); None when it is not determined."""
    usable = [p for p in pts if p.feasible and p.cycle_ms is not None]
    if len(usable) < MIN_FIT_TRIALS:
        return None
    x = np.array([[1.0, p.steps, p.draft_tokens] for p in usable])
    y = np.array([p.cycle_ms for p in usable], dtype=float)
    if np.linalg.matrix_rank(x) < 3:  # e.g. every trial topk 1: draft tokens = steps + 1
        return None
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid**2)) / total if total > 0 else 1.0
    return CycleFit(float(coef[0]), float(coef[1]), float(coef[2]), r2, len(usable))


def failures_by_kind(trials: Sequence[TrialRow]) -> Counter[str]:
    """Failure kinds told to Optuna, plus trials that ended FAIL (host faults after retries)."""
    kinds: Counter[str] = Counter()
    for t in trials:
        if t.duplicate_of is not None:  # answered from another trial, never launched
            continue
        if t.failure_kind:
            kinds[t.failure_kind] += 1
        elif t.state == "FAIL":
            kinds["gave up (host faults)"] += 1
    return kinds


def levels_measured(pts: list[Point]) -> list[int]:
    return sorted({c for p in pts for c in p.speedup_by_level})
