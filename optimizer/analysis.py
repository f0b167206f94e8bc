"""What a result means: the speedup with its uncertainty, from the repeated passes."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# 95% two-sided normal quantile; with 3-5 repeats this is a readable, slightly optimistic band.
Z95 = 1.96


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float

    @property
    def half_width_pct(self) -> float:
        return 100.0 * (self.high - self.low) / 2.0 / self.value if self.value else 0.0


def ratio_interval(trial_runs: Sequence[float], base_runs: Sequence[float], z: float = Z95) -> Interval | None:
    """Interval for mean(trial)/mean(base) by the delta method on the log ratio.

    None when either side has fewer than two passes (no spread to speak of).
    """
    if len(trial_runs) < 2 or len(base_runs) < 2:
        return None
    mt, mb = statistics.fmean(trial_runs), statistics.fmean(base_runs)
    if mt <= 0 or mb <= 0:
        return None
    var = (statistics.variance(trial_runs) / mt**2) / len(trial_runs) + (statistics.variance(base_runs) / mb**2) / len(
        base_runs
    )
    r = mt / mb
    half = z * math.sqrt(var)
    return Interval(r, r * math.exp(-half), r * math.exp(half))


def level_intervals(
    levels: Sequence[Mapping[str, Any]], baseline_levels: Sequence[Mapping[str, Any]]
) -> dict[int, Interval]:
    """The 95% interval of each level's speedup.

    A level either side marked saturated (the load generator or the host could not keep up,
    workers/loadgen/saturation.py) gets none: its spread is the host's, not the configuration's.
    """
    base = {int(b["concurrency"]): b for b in baseline_levels}
    out: dict[int, Interval] = {}
    for lv in levels:
        c = int(lv["concurrency"])
        if c in base and not (lv.get("saturated") or base[c].get("saturated")):
            iv = ratio_interval(lv.get("output_tok_s_runs") or [], base[c].get("output_tok_s_runs") or [])
            if iv is not None:
                out[c] = iv
    return out
