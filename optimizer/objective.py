"""The objective: speedup over the same host's baseline, and the latency constraints.

speedup(level) = trial output tok/s / baseline output tok/s at that concurrency, both measured on
the same host with the same prompts, order, output length and sampling settings.  The study's
objective is that ratio at one level, or the geometric mean over all levels (a configuration that
doubles one level and halves another is then worth exactly 1.0).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from optimizer.errors import SpecError
from optimizer.spec import Objective

# The single constraint key every COMPLETE trial carries (GP needs the same keys on all trials;
# docs/optuna.md §5).  <= 0 is feasible; failures and latency overruns make it positive.
CONSTRAINT_KEY = "spectune_violation"
# Magnitude told for a configuration that could not run at all (OOM, invalid, launch timeout):
# larger than any plausible latency overrun so TPE ranks it last among infeasible trials.
FAILED_LAUNCH_VIOLATION = 10.0


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    output_tok_s: float
    itl_ms_p99: float | None = None
    ttft_ms_p99: float | None = None


@dataclass(frozen=True)
class Score:
    value: float
    speedups: dict[int, float]
    violation: float


def speedups(levels: Sequence[LevelResult], baseline_tok_s: Mapping[int, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for lv in levels:
        base = baseline_tok_s.get(lv.concurrency)
        if base is None or base <= 0:
            raise SpecError(
                "baseline", f"no baseline throughput at concurrency {lv.concurrency}: measure the baseline first"
            )
        out[lv.concurrency] = lv.output_tok_s / base
    return out


def geometric_mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("geometric mean of nothing")
    if any(v <= 0 for v in values):
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def score(objective: Objective, levels: Sequence[LevelResult], baseline_tok_s: Mapping[int, float]) -> Score:
    """The value told to Optuna and the constraint violation (<= 0 when every limit holds)."""
    per_level = speedups(levels, baseline_tok_s)
    if objective.concurrency is not None:
        if objective.concurrency not in per_level:
            raise SpecError("objective.concurrency", f"level {objective.concurrency} was not measured")
        value = per_level[objective.concurrency]
    else:
        value = geometric_mean(list(per_level.values()))
    violation = 0.0
    for lv in levels:
        # Relative overrun, so "10% over the limit" weighs the same for any limit.
        if objective.max_p99_itl_ms is not None and lv.itl_ms_p99 is not None:
            violation = max(violation, lv.itl_ms_p99 / objective.max_p99_itl_ms - 1.0)
        if objective.max_p99_ttft_ms is not None and lv.ttft_ms_p99 is not None:
            violation = max(violation, lv.ttft_ms_p99 / objective.max_p99_ttft_ms - 1.0)
    return Score(value=value, speedups=per_level, violation=violation if violation > 0 else 0.0)
