"""Plausibility before trust: a report weighed against what the study knows (issue 35).

The checks are optimizer.plausibility's; this module reads what they compare with (the lease's
own duration, other tokens' baselines of the same key, the host's earlier baseline, the baseline
a result is divided by) and turns an implausible report into a host fault that is never scored:
a trial or confirmation is retried elsewhere, a baseline is not stored, and the host's health
pays, so a liar is quarantined like any sick host.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.models import BaselineRow, LeaseRow
from api.services.lease_rows import LeasePayload
from api.services.leasing import records
from api.services.leasing.states import LeaseKind
from api.services.study_specs import baseline_key_of
from optimizer import plausibility as P
from optimizer.spec import StudySpec
from spectune_protocol import CompleteIn, Failure

# Event of a report quarantined for what it claims (shown with the study's and worker's events).
IMPLAUSIBLE = "implausible_report"


def judge(s: Session, spec: StudySpec, lease: LeaseRow, body: CompleteIn, now: datetime) -> str | None:
    """Why this successful report cannot be trusted, or None (failures are not judged here)."""
    if body.outcome != "ok" or body.metrics is None or lease.worker_id is None:
        return None
    levels = [P.Level(lv.concurrency, lv.output_tok_s, lv.accept_length) for lv in body.metrics.levels]
    started = lease.leased_at or lease.created_at
    problem = P.pace_problem(spec.workload, levels, (now - started).total_seconds())
    if problem is not None:
        return problem
    key = baseline_key_of(spec)
    if lease.kind == LeaseKind.BASELINE:
        own = records.latest_baseline(s, lease.worker_id, key)
        return P.baseline_problem(
            levels, _peer_baselines(s, key, lease), None if own is None else records.baseline_tok_s(own)
        )
    payload = LeasePayload.of(lease)
    baseline_id = payload.confirm_info.baseline_id
    base_row = s.get(BaselineRow, baseline_id) if baseline_id is not None else None
    if base_row is None:
        base_row = records.latest_baseline(s, lease.worker_id, key)
    if base_row is None:
        return None  # the lease's own path answers "no baseline"
    # The adaptive proof carries its initial chain, but the engine picks each batch's chain (steps 0
    # included, cycles that verify nothing): no static chain's bound holds for its report.
    config = None if payload.confirm_info.adaptive else payload.config
    return P.speedup_problem(config, levels, records.baseline_tok_s(base_row))


def _peer_baselines(s: Session, key: str, lease: LeaseRow) -> list[dict[int, float]]:
    """The latest baseline of the same key of each other token (a worker id stands for its token
    where a baseline predates migration 0007): one token's many worker ids count once."""
    rows = s.execute(
        select(BaselineRow, LeaseRow.token_id)
        .join(LeaseRow, LeaseRow.id == BaselineRow.lease_id, isouter=True)
        .where(BaselineRow.baseline_key == key, BaselineRow.worker_id != lease.worker_id)
        .order_by(BaselineRow.measured_at)
    )
    latest: dict[Any, dict[int, float]] = {}
    for row, token in rows:
        if token is not None and token == lease.token_id:
            continue
        latest[token if token is not None else f"worker:{row.worker_id}"] = records.baseline_tok_s(row)
    return list(latest.values())


def quarantined(problem: str) -> CompleteIn:
    """The report as the lease's path takes it: a host fault, retried elsewhere, never told to Optuna
    (the report itself is kept with the lease, `keep_original`)."""
    return CompleteIn(
        outcome="failed",
        failure=Failure(kind="benchmark_error", message=f"implausible report, not scored: {problem}", host_fault=True),
    )


def keep_original(s: Session, lease_id: str, original: CompleteIn, problem: str) -> None:
    """Keep what the worker reported next to the failure it was turned into: nothing is lost."""
    lease = s.get(LeaseRow, lease_id)
    if lease is not None:
        lease.result = {
            **(lease.result or {}),
            "implausible": problem,
            "reported": original.model_dump(mode="json", exclude={"metrics": {"log_tail"}}),
        }
