"""More passes on the warm server while a confirmation straddles a decision (issue 17 item 4).

A confirm lease may carry a `Resolve` order.  After its levels the server is still up and warm:
adding passes there costs no launch, and narrows the candidate's share of the interval.  The
worker adds `repeats` passes at a time at the objective's levels while the interval holds a
threshold and more passes could still clear it (optimizer.analysis.undecided), up to the
order's cap.  The added passes join each level's `output_tok_s_runs` and mean; the count and
the reason they stopped go into the report (`Metrics.extra_passes`, `extra_passes_note`).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence

from optimizer.analysis import undecided
from spectune_protocol import LevelMetrics, Resolve

log = logging.getLogger("spectune.worker")

Measure = Callable[[list[int], int], list[LevelMetrics]]
"""Measures `passes` more timed passes (no warm-up) at the given levels on the running server."""


def merge(level: LevelMetrics, more: LevelMetrics) -> LevelMetrics:
    """A level with more passes of the same server: runs appended, mean and counts over all."""
    runs = [*level.output_tok_s_runs, *more.output_tok_s_runs]
    saturated = level.saturated or more.saturated
    return level.model_copy(
        update={
            "output_tok_s_runs": runs,
            "output_tok_s": statistics.fmean(runs),
            "completion_tokens": (level.completion_tokens or 0) + (more.completion_tokens or 0),
            "num_requests": (level.num_requests or 0) + (more.num_requests or 0),
            "saturated": saturated,
        }
    )


def resolve(
    order: Resolve, levels: Sequence[LevelMetrics], repeats: int, measure: Measure
) -> tuple[list[LevelMetrics], int, str]:
    """The levels with any extra passes, the extra passes per level, and why they stopped."""
    by_level = {m.concurrency: m for m in levels}
    wanted = [order.objective_concurrency] if order.objective_concurrency is not None else list(order.levels)
    wanted = [c for c in wanted if c in by_level]
    base = {int(k): v for k, v in order.baseline_runs.items()}
    extra = 0
    step = max(1, repeats)
    for _ in range(order.max_passes + 1):  # bounded: each turn adds >= 1 pass up to the cap
        threshold, could = undecided(
            levels=order.levels,
            objective_concurrency=order.objective_concurrency,
            trial_runs={c: m.output_tok_s_runs for c, m in by_level.items()},
            baseline_runs=base,
            thresholds=order.thresholds,
            extra_var=order.extra_var,
        )
        if threshold is None:
            note = "resolved" if extra else "decided without extra passes"
            break
        if not could:
            note = (
                f"the interval holds {threshold:.3f}, and more passes cannot clear it: the rest is the "
                "baseline's passes and the launch-to-launch noise"
            )
            break
        if extra >= order.max_passes:
            note = f"the interval still holds {threshold:.3f} at the cap of {order.max_passes} extra passes per level"
            break
        k = min(step, order.max_passes - extra)
        log.info("the interval holds %.3f: %d more passes at concurrency %s", threshold, k, wanted)
        for m in measure(wanted, k):
            if m.concurrency in by_level:
                by_level[m.concurrency] = merge(by_level[m.concurrency], m)
        extra += k
    return [by_level[m.concurrency] for m in levels], extra, note
