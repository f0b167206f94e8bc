"""What a study cost: launches and GPU-hours, split by what they were for, next to SGLang's grid.

A launch is one server start (weights, CUDA graphs) and its benchmark.  GPU-hours = (launch +
benchmark time, i.e. the lease's wall time) x the GPUs of the host that ran it.  Kinds:

* baselines: the servers without speculation every host measures (also the fresh ones of the
  confirmation);
* search: trials that ran (pruned ones included);
* confirmation: re-measurements of the candidates;
* failed: launches that did not run (out of memory, crashed, timed out), whatever their kind.

The comparison is what SGLang's `bench_speculative.py` grid would have cost on the same engine:
its launch count (every valid point of steps 1,3,5,7 x topk 1,2,4,8 x draft tokens
2,4,8,16,32, each a fresh server, plus one baseline) x the median cost of a launch measured in
this study.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from optimizer.space import SpecConfig
from optimizer.words import plural

KINDS = ("baselines", "search", "confirmation", "failed")
GRID_STEPS = (1, 3, 5, 7)
GRID_TOPK = (1, 2, 4, 8)
GRID_NDT = (2, 4, 8, 16, 32)


def grid_points() -> list[SpecConfig]:
    """bench_speculative.py's grid in its loop order: points with draft tokens > steps*topk + 1
    are skipped (its own rule, stricter than the server's)."""
    return [
        SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)
        for s in GRID_STEPS
        for k in GRID_TOPK
        for n in GRID_NDT
        if n <= s * k + 1
    ]


@dataclass(frozen=True)
class Launch:
    kind: str  # one of KINDS
    seconds: float  # launch + benchmark wall time
    gpus: int


@dataclass
class Cost:
    launches: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    gpu_hours: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    median_launch_gpu_hours: float | None = None
    grid_launches: int = len(grid_points()) + 1
    # Passes added on warm confirmation servers to resolve an undecided answer (no launch; their
    # time is in the confirmation's GPU-hours).
    extra_passes: int = 0

    @property
    def total_launches(self) -> int:
        return sum(self.launches.values())

    @property
    def total_gpu_hours(self) -> float:
        return sum(self.gpu_hours.values())

    @property
    def grid_gpu_hours(self) -> float | None:
        m = self.median_launch_gpu_hours
        return None if m is None else m * self.grid_launches

    def as_json(self) -> dict[str, Any]:
        return {
            "launches": self.total_launches,
            "gpu_hours": self.total_gpu_hours,
            "launches_by_kind": dict(self.launches),
            "gpu_hours_by_kind": dict(self.gpu_hours),
            "median_launch_gpu_hours": self.median_launch_gpu_hours,
            "bench_speculative_grid": {"launches": self.grid_launches, "gpu_hours": self.grid_gpu_hours},
            "extra_passes": self.extra_passes,
            "summary": self.summary(),
        }

    def summary(self) -> str:
        n = self.launches
        parts = (
            f"{plural(self.total_launches, 'launch', 'launches')}, {self.total_gpu_hours:.2f} GPU-hours "
            f"({plural(n['baselines'], 'baseline')}, {n['search']} search, {n['confirmation']} confirmation, "
            f"{n['failed']} failed)"
        )
        if self.extra_passes:
            parts += (
                f"; {plural(self.extra_passes, 'extra pass', 'extra passes')} on warm servers to resolve the answer"
            )
        grid = self.grid_gpu_hours
        if grid is not None:
            launches = plural(self.grid_launches, "launch", "launches")
            parts += f"; SGLang's bench_speculative grid: {launches}, about {grid:.2f} GPU-hours"
        return parts


def tally(launches: Iterable[Launch], extra_passes: int = 0) -> Cost:
    cost = Cost(extra_passes=extra_passes)
    per_launch: list[float] = []
    for la in launches:
        h = max(la.seconds, 0.0) * max(la.gpus, 1) / 3600.0
        cost.launches[la.kind] += 1
        cost.gpu_hours[la.kind] += h
        if la.kind != "failed":
            per_launch.append(h)
    cost.median_launch_gpu_hours = statistics.median(per_launch) if per_launch else None
    return cost
