"""Checks of a worker's report against its lease, before anything of it is stored or told.

The wire model (spectune_protocol) bounds every number; these checks need the lease: the levels of
an `ok` report must be distinct levels of the lease's workload, and a baseline or confirmation
must measure all of them (a trial may stop early, when pruned).  The levels a `failed` report
says were measured before the failure are held to the lease's levels too (a concurrency of 2048
was once stored for a lease of level 1).  A report that breaks them is answered 422, so it can
never make a study's later speedups impossible to compute.
"""

from __future__ import annotations

from api.errors import InvalidInputError
from api.services.lease_rows import LeasePayload
from spectune_protocol import CompleteIn


def check_report(kind: str, payload: LeasePayload, body: CompleteIn) -> None:
    expected = set(payload.workload.concurrency)
    if body.failure is not None and body.failure.levels:
        _check_levels("failure.levels", [lv.concurrency for lv in body.failure.levels], expected)
    if body.outcome != "ok" or body.metrics is None:
        return
    reported = [lv.concurrency for lv in body.metrics.levels]
    _check_levels("metrics.levels", reported, expected)
    if kind != "trial" and expected and set(reported) != expected:
        raise InvalidInputError(
            f"metrics.levels: a {kind} must measure every level of the workload {sorted(expected)}, got {reported}",
            field="metrics.levels",
        )


def _check_levels(field: str, reported: list[int], expected: set[int]) -> None:
    if len(set(reported)) != len(reported):
        raise InvalidInputError(f"{field}: a concurrency level is reported twice: {reported}", field=field)
    if expected and not set(reported) <= expected:
        raise InvalidInputError(
            f"{field}: levels {sorted(set(reported) - expected)} are not in the lease's workload {sorted(expected)}",
            field=field,
        )
