"""The objective: a ratio over the same host's baseline, and the latency constraints.

speedup(level) = trial figure / baseline figure at that concurrency, both measured on the same
host with the same prompts, order, output length and sampling settings.  The figure is the
objective's metric (`optimizer.spec.Objective`): output tok/s, per-user tok/s, goodput, or the
inverse of a TTFT / ITL percentile, so that every ratio reads "> 1 is better" (for a latency,
baseline / trial).  The study's objective is that ratio at one level, or the geometric mean over
all levels (a configuration that doubles one level and halves another is then worth exactly 1.0).

Everything downstream (the stop rule, confirmation, intervals, verdict) reads a level's figure
and its per-pass values through `objective_view`, which puts them where output tok/s sits, so one
code path judges every objective.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optimizer.analysis import Interval, level_intervals
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
    # Goodput counts the requests meeting the limits: they define the objective, not a constraint.
    for lv in levels if objective.name != "goodput" else ():
        # Relative overrun, so "10% over the limit" weighs the same for any limit.
        if objective.max_p99_itl_ms is not None and lv.itl_ms_p99 is not None:
            violation = max(violation, lv.itl_ms_p99 / objective.max_p99_itl_ms - 1.0)
        if objective.max_p99_ttft_ms is not None and lv.ttft_ms_p99 is not None:
            violation = max(violation, lv.ttft_ms_p99 / objective.max_p99_ttft_ms - 1.0)
    return Score(value=value, speedups=per_level, violation=violation if violation > 0 else 0.0)


# A goodput of zero (no request met the SLO) is read as this share of the level's own rate (its
# requests/s or tok/s), so a ratio over it stays finite: "fewer than 1 in 100 met it", the
# resolution of a benchmark of a few hundred requests at most.
GOODPUT_FLOOR_SHARE = 0.01


def figure_key(objective: Objective) -> str:
    """The level field (`spectune_protocol.LevelMetrics`) the objective compares."""
    name = objective.name
    if name == "per_user":
        return "per_user_tok_s"
    if name in ("ttft", "itl"):
        return f"{name}_ms_p{objective.percentile}"
    if name == "goodput":
        return f"goodput_{objective.goodput_unit}"
    return "output_tok_s"


def lower_is_better(objective: Objective) -> bool:
    return objective.name in ("ttft", "itl")


def metric_words(objective: Objective) -> str:
    """The metric in a few words, as the verdict names it ("speculation pays on per-user tok/s")."""
    name = objective.name
    if name in ("ttft", "itl"):
        return f"p{objective.percentile} {name.upper()}"
    return {"per_user": "per-user tok/s", "goodput": "goodput"}.get(name, "output throughput")


def describe(objective: Objective, levels: Sequence[int] = ()) -> str:
    """The objective in words, for the first line of the verdict, report, Pareto view and dashboard;
    `levels`: the workload's concurrency levels (one level is named, not called a mean)."""
    name = objective.name
    level = objective.concurrency if objective.concurrency is not None else (levels[0] if len(levels) == 1 else None)
    where = "the geometric mean over levels" if level is None else f"concurrency {level}"
    if name == "per_user":
        what = "per-user tok/s speedup"
    elif name in ("ttft", "itl"):
        what = f"p{objective.percentile} {name.upper()} ratio (baseline / trial)"
    elif name == "goodput":
        limits = [
            f"{label} <= {v:g} ms"
            for label, v in (("TTFT", objective.max_p99_ttft_ms), ("time per output token", objective.max_p99_itl_ms))
            if v is not None
        ]
        unit = "requests/s" if objective.goodput_unit == "req_s" else "tok/s"
        what = f"goodput speedup ({unit} of requests with {' and '.join(limits)})"
    else:
        what = "output-throughput speedup"
    return f"objective: {what}, at {where}"


def slo_of(objective: Objective) -> dict[str, float | None] | None:
    """What the worker counts goodput against (`spectune_protocol.Slo`), or None for other metrics."""
    if objective.name != "goodput":
        return None
    return {"ttft_ms": objective.max_p99_ttft_ms, "itl_ms": objective.max_p99_itl_ms}


def _figure(objective: Objective, value: Any, floor: float) -> float | None:
    if value is None:
        return None
    v = float(value)
    if lower_is_better(objective):
        # Milliseconds to a rate: trial / baseline of 1/ms is baseline / trial of the latency.
        return 1000.0 / v if v > 0 else None
    return max(v, floor)


def _goodput_floor(objective: Objective, lv: Mapping[str, Any]) -> float:
    """GOODPUT_FLOOR_SHARE of the level's rate in the objective's unit (0 for other metrics)."""
    if objective.name != "goodput":
        return 0.0
    tok_s = float(lv.get("output_tok_s") or 0.0)
    if objective.goodput_unit == "tok_s":
        return GOODPUT_FLOOR_SHARE * tok_s
    tokens, requests = lv.get("completion_tokens"), lv.get("num_requests")
    req_s = tok_s * requests / tokens if tokens and requests else 0.0
    return GOODPUT_FLOOR_SHARE * req_s if req_s > 0 else 1e-6


def objective_view(objective: Objective, levels: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The levels as the objective reads them: `output_tok_s` and `output_tok_s_runs` hold its
    figure (higher is better) and that figure's per-pass values.  Unchanged for throughput; a
    level that lacks the figure (a report from before the objective, or a latency of 0) keeps no
    figure and no runs, so no ratio or interval is derived from it."""
    if objective.name == "throughput":
        return list(levels)
    key = figure_key(objective)
    out: list[Mapping[str, Any]] = []
    for lv in levels:
        floor = _goodput_floor(objective, lv)
        value = _figure(objective, lv.get(key), floor)
        runs = [_figure(objective, x, floor) for x in (lv.get("runs") or {}).get(key) or []]
        out.append(
            {
                **lv,
                "output_tok_s": value,
                "output_tok_s_runs": [x for x in runs if x is not None] if None not in runs else [],
            }
        )
    return out


def score_levels(
    objective: Objective, levels: Sequence[Mapping[str, Any]], baseline_levels: Sequence[Mapping[str, Any]]
) -> Score:
    """`score` of measured level documents against the same host's baseline levels, by the objective's figure."""
    view, base_view = objective_view(objective, levels), objective_view(objective, baseline_levels)
    base = {int(b["concurrency"]): float(b["output_tok_s"]) for b in base_view if b.get("output_tok_s")}
    results = [
        LevelResult(
            int(lv["concurrency"]), float(lv["output_tok_s"] or 0.0), lv.get("itl_ms_p99"), lv.get("ttft_ms_p99")
        )
        for lv in view
        if int(lv["concurrency"]) in base
    ]
    return score(objective, results, base)


def objective_intervals(
    objective: Objective,
    levels: Sequence[Mapping[str, Any]],
    baseline_levels: Sequence[Mapping[str, Any]],
    extra_var: float = 0.0,
) -> dict[int, Interval]:
    """The 95% interval of each level's ratio of the objective's figure (`analysis.level_intervals`)."""
    return level_intervals(objective_view(objective, levels), objective_view(objective, baseline_levels), extra_var)
