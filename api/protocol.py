"""Moved to `spectune_protocol` (a package both the API and the worker import).

Kept as a re-export so code written against the old path keeps working; import from
`spectune_protocol` in new code.
"""

from spectune_protocol import (
    CompleteIn,
    CompleteOut,
    Failure,
    FailureKind,
    GpuInfo,
    HeartbeatOut,
    Inventory,
    LeaseKind,
    LeaseOut,
    LeaseState,
    LevelMetrics,
    Metrics,
    ProgressIn,
    ProgressOut,
)

__all__ = [
    "CompleteIn",
    "CompleteOut",
    "Failure",
    "FailureKind",
    "GpuInfo",
    "HeartbeatOut",
    "Inventory",
    "LeaseKind",
    "LeaseOut",
    "LeaseState",
    "LevelMetrics",
    "Metrics",
    "ProgressIn",
    "ProgressOut",
]
