"""Checks of a worker's report against its lease, before anything of it is stored or told.

The wire model (spectune_protocol) bounds every number; these checks need the lease: the levels of
an `ok` report must be distinct levels of the lease's workload, and a baseline or confirmation
must measure all of them (a trial may stop early, when pruned).  A report that breaks them is
answered 422, so it can never make a study's later speedups impossible to compute.
"""

from __future__ import annotations

from typing import Any

from api.errors import InvalidInputError
from spectune_protocol import CompleteIn


def check_report(kind: str, payload: dict[str, Any], body: CompleteIn) -> None:
    if body.outcome != "ok" or body.metrics is None:
        return
    expected = set((payload.get("workload") or {}).get("concurrency") or [])
    reported = [lv.concurrency for lv in body.metrics.levels]
    if len(set(reported)) != len(reported):
        raise InvalidInputError(
            f"metrics.levels: a concurrency level is reported twice: {reported}", field="metrics.levels"
        )
    if expected and not set(reported) <= expected:
        raise InvalidInputError(
            f"metrics.levels: levels {sorted(set(reported) - expected)} are not in the lease's workload "
            f"{sorted(expected)}",
            field="metrics.levels",
        )
    if kind != "trial" and expected and set(reported) != expected:
        raise InvalidInputError(
            f"metrics.levels: a {kind} must measure every level of the workload {sorted(expected)}, got {reported}",
            field="metrics.levels",
        )
