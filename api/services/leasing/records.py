"""What every kind of lease shares: its wire form, events, host health (the row builder is
api.services.lease_rows).

Kept free of any decision about *which* lease to hand out: baseline.py, trial.py and confirm.py
make those, each for its own kind.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.db import db_now
from api.models import BaselineRow, EventRow, LeaseRow, TrialConfigRow, WorkerIdentity, WorkerRow
from api.services.lease_rows import LeasePayload
from api.services.leasing.states import ConfigState
from api.settings import Settings
from optimizer.store import CONFIG_FAILURES as CONFIG_FAILURES
from optimizer.store import DEPLOY_FAILED as DEPLOY_FAILED
from optimizer.store import DEPLOY_RETRY as DEPLOY_RETRY
from optimizer.words import plural
from spectune_protocol import LeaseKind, LeaseOut

log = logging.getLogger("spectune.api.leasing")

# CONFIG_FAILURES (failure kinds caused by the configuration itself, taught to the sampler as
# infeasible) and the deployment proof's events (issue 17 item 2) are defined with the actions
# that use them (optimizer/store.py) and re-exported here for the service.


def counts_against_host(kind: str) -> bool:
    """Does a failure of this kind count towards quarantining its host?

    `lost` is a worker shutting down; `refused` is the worker declining what the *study* asks
    (a flag outside its allowlist, a model it lacks); `request_rejected` is the engine refusing
    the study's own requests (a prompt longer than the context): none says the host is sick.
    """
    return kind not in ("lost", "refused", "request_rejected")


def lease_out(lease: LeaseRow, settings: Settings) -> LeaseOut:
    assert lease.deadline is not None
    p = LeasePayload.of(lease)
    return LeaseOut(
        lease_id=lease.id,
        kind=LeaseKind(lease.kind),
        study=lease.study_name,
        trial_number=lease.trial_number,
        attempt=lease.attempt,
        deadline=lease.deadline.replace(tzinfo=UTC),
        heartbeat_interval_s=settings.heartbeat_interval_s,
        server=p.server,
        workload=p.workload,
        config=p.config,
        resolve=p.resolve,
        slo=p.slo,
    )


def event(s: Session, kind: str, lease: LeaseRow, detail: str) -> None:
    s.add(
        EventRow(
            at=db_now(s),
            kind=kind,
            study_name=lease.study_name,
            worker_id=lease.worker_id,
            lease_id=lease.id,
            detail=detail,
        )
    )


def baselines_valid_since(s: Session, worker_id: str) -> datetime | None:
    """Baselines of `worker_id` measured before this were a previous token's (api.services.identity)."""
    row = s.get(WorkerIdentity, worker_id)
    return None if row is None else row.moved_at


def latest_baseline(s: Session, worker_id: str, key: str) -> BaselineRow | None:
    q = select(BaselineRow).where(BaselineRow.worker_id == worker_id, BaselineRow.baseline_key == key)
    if (since := baselines_valid_since(s, worker_id)) is not None:
        q = q.where(BaselineRow.measured_at >= since)
    return s.scalars(q.order_by(BaselineRow.measured_at.desc()).limit(1)).first()


def baseline_tok_s(row: BaselineRow) -> dict[int, float]:
    return {int(k): float(v) for k, v in row.tok_s.items()}


def set_config_state(s: Session, study: str, key: str | None, state: ConfigState) -> None:
    if key is None:
        return
    row = s.scalars(
        select(TrialConfigRow).where(TrialConfigRow.study_name == study, TrialConfigRow.config_key == key)
    ).first()
    if row is not None:
        row.state = state.value


def touch_seen(s: Session, worker_id: str | None, now: datetime) -> None:
    if worker_id is not None and (w := s.get(WorkerRow, worker_id)) is not None:
        w.last_seen = now


class HostHealth:
    """Consecutive host failures per worker, and quarantine after `quarantine_after` of them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def failure(self, s: Session, worker_id: str, reason: str) -> None:
        w = s.get(WorkerRow, worker_id)
        if w is None:
            return
        w.consecutive_host_failures += 1
        if w.consecutive_host_failures >= self.settings.quarantine_after and not w.quarantined:
            w.quarantined = True
            failures = plural(w.consecutive_host_failures, "host failure")
            w.quarantine_reason = f"{failures} in a row; last: {reason}"[:512]
            s.add(EventRow(at=db_now(s), kind="worker_quarantined", worker_id=worker_id, detail=w.quarantine_reason))
            log.warning("worker %s quarantined: %s", worker_id, w.quarantine_reason)

    @staticmethod
    def success(s: Session, worker_id: str) -> None:
        w = s.get(WorkerRow, worker_id)
        if w is not None:
            w.consecutive_host_failures = 0
