"""Baseline leases: the same server without speculation, measured on each host before its trials.

A worker gets a baseline lease for a study when it has no baseline for the study's baseline key
younger than `baseline_max_age_s` (so drift does not pose as speedup), and before each
confirmation (confirm.py pairs them).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.context import Unit
from api.db import db_now
from api.models import BaselineRow, LeaseRow
from api.services import studies as study_svc
from api.services.leasing import records
from api.services.leasing.records import HostHealth, counts_against_host, event
from api.services.leasing.states import LeaseKind, LeaseState, end
from api.settings import Settings
from optimizer.spec import StudySpec
from spectune_protocol import CompleteIn, CompleteOut


class BaselineLeases:
    def __init__(self, settings: Settings, health: HostHealth) -> None:
        self.settings = settings
        self.health = health

    def has_fresh(self, s: Session, worker_id: str, key: str, now: datetime) -> bool:
        since = now - timedelta(seconds=self.settings.baseline_max_age_s)
        moved = records.baselines_valid_since(s, worker_id)
        if moved is not None:
            since = max(since, moved)
        found = s.scalars(
            select(BaselineRow.id).where(
                BaselineRow.worker_id == worker_id, BaselineRow.baseline_key == key, BaselineRow.measured_at >= since
            )
        ).first()
        return found is not None

    def new(self, s: Session, spec: StudySpec, worker_id: str, now: datetime) -> LeaseRow | None:
        """A baseline lease, active for `worker_id`; None when the worker got another one meanwhile."""
        lease = records.new_lease_row(
            spec, LeaseKind.BASELINE, now, self.settings.lease_ttl_s, worker_id=worker_id, config=None, number=None
        )
        try:
            # Added inside the savepoint (see LeaseService._touch_worker).
            with s.begin_nested():
                s.add(lease)
                s.flush()
        except IntegrityError:
            # Only the one-active-lease-per-worker index can fire here: a concurrent request of
            # the same worker won; it will be handed that lease when it asks again.  The
            # savepoint's rollback already made the row transient (expunging it again raised
            # InvalidRequestError, answered as "database unavailable").
            return None
        return lease

    def complete(self, u: Unit, spec: StudySpec, lease_id: str, body: CompleteIn, late: bool) -> CompleteOut:
        with u.step() as s:
            now = db_now(s)
            lease = s.get(LeaseRow, lease_id)
            assert lease is not None and lease.worker_id is not None
            ok = body.outcome == "ok" and body.metrics is not None
            end(s, lease, LeaseState.COMPLETED if ok else LeaseState.FAILED, now, result=body.model_dump(mode="json"))
            if ok:
                assert body.metrics is not None
                s.add(
                    BaselineRow(
                        worker_id=lease.worker_id,
                        baseline_key=study_svc.baseline_key_of(spec),
                        lease_id=lease.id,
                        measured_at=now,
                        tok_s={str(lv.concurrency): lv.output_tok_s for lv in body.metrics.levels},
                        metrics=body.metrics.model_dump(mode="json"),
                    )
                )
                self.health.success(s, lease.worker_id)
            else:
                assert body.failure is not None
                if counts_against_host(body.failure.kind):
                    reason = f"baseline failed: {body.failure.kind}: {body.failure.message}"
                    self.health.failure(s, lease.worker_id, reason)
            if late:
                event(s, "late_report_kept", lease, "baseline reported after its lease expired")
            return CompleteOut(lease_id=lease.id, state=lease.state)
