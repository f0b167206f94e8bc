"""Confirmation leases: the best candidates re-measured, each right after a fresh baseline.

Queued by `studies.start_confirmation` once the search is over.  A confirm lease is handed to a
worker only when its latest baseline was measured after the confirmation began (one fresh
baseline serves all of a host's confirmations), and after its previous confirmation ended where
that host's baseline drifted (`studies.confirm_baseline_serves`); otherwise the worker gets that
baseline first.
A candidate is confirmed on another worker than the one that measured it, when one is alive.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.context import ServiceContext, Unit
from api.db import db_now
from api.models import BaselineRow, LeaseRow, WorkerRow
from api.services import studies as study_svc
from api.services.leasing import records
from api.services.leasing.baseline import BaselineLeases
from api.services.leasing.records import CONFIG_FAILURES, HostHealth, event
from api.services.leasing.states import LeaseKind, LeaseState, claim, end
from optimizer import confirmation as confirm
from optimizer.spec import StudySpec
from spectune_protocol import CompleteIn, CompleteOut

log = logging.getLogger("spectune.api.leasing")


class ConfirmLeases:
    def __init__(self, ctx: ServiceContext, health: HostHealth, baselines: BaselineLeases) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.health = health
        self.baselines = baselines

    def lease(self, s: Session, spec: StudySpec, worker_id: str, key: str, now: datetime) -> LeaseRow | None:
        """A queued confirmation for this worker, or the baseline it must measure first."""
        queued = s.scalars(
            select(LeaseRow)
            .where(
                LeaseRow.study_name == spec.name,
                LeaseRow.kind == LeaseKind.CONFIRM,
                LeaseRow.state == LeaseState.QUEUED,
            )
            .order_by(LeaseRow.created_at, LeaseRow.trial_number)
            .with_for_update(skip_locked=True)
        ).all()
        for lease in queued:
            avoid = (lease.payload.get("confirm") or {}).get("avoid_worker")
            if avoid == worker_id and self._another_capable_worker(s, key, worker_id, now):
                continue
            base = records.latest_baseline(s, worker_id, key)
            if base is None or not study_svc.confirm_baseline_serves(s, spec, worker_id, base):
                return self.baselines.new(s, spec, worker_id, now)
            info = dict(lease.payload.get("confirm") or {})
            info["baseline_id"] = base.id
            payload = {**lease.payload, "confirm": info, "resolve": study_svc.resolve_order(s, spec, base, lease)}
            claim(s, lease, worker_id, now, self.settings.lease_ttl_s, payload=payload)
            log.info("lease %s: study %s confirms trial %s on %s", lease.id, spec.name, lease.trial_number, worker_id)
            return lease
        return None

    def _another_capable_worker(self, s: Session, key: str, worker_id: str, now: datetime) -> bool:
        """Is another live, healthy worker able to run this study (it measured its baseline)?"""
        since = now - timedelta(seconds=3 * self.settings.lease_ttl_s)
        found = s.scalars(
            select(WorkerRow.id)
            .join(BaselineRow, BaselineRow.worker_id == WorkerRow.id)
            .where(
                BaselineRow.baseline_key == key,
                WorkerRow.id != worker_id,
                WorkerRow.quarantined.is_(False),
                WorkerRow.last_seen >= since,
            )
            .limit(1)
        ).first()
        return found is not None

    def complete(self, u: Unit, spec: StudySpec, lease_id: str, body: CompleteIn, late: bool) -> CompleteOut:
        """A candidate re-measured: its speedup and interval against the baseline paired with it."""
        trials = study_svc.study_trials(self.ctx.storage, spec.name)
        with u.step() as s:
            now = db_now(s)
            lease = s.get(LeaseRow, lease_id)
            assert lease is not None and lease.worker_id is not None
            info = dict(lease.payload.get("confirm") or {})
            key = study_svc.baseline_key_of(spec)
            base_row = s.get(BaselineRow, info["baseline_id"]) if "baseline_id" in info else None
            if base_row is None:
                base_row = records.latest_baseline(s, lease.worker_id, key)
            if late:
                for other in s.scalars(
                    select(LeaseRow).where(
                        LeaseRow.study_name == spec.name,
                        LeaseRow.kind == LeaseKind.CONFIRM,
                        LeaseRow.trial_number == lease.trial_number,
                        LeaseRow.state.in_((LeaseState.QUEUED, LeaseState.ACTIVE)),
                        LeaseRow.id != lease.id,
                    )
                ):
                    end(s, other, LeaseState.SUPERSEDED, now)
                event(s, "late_report_kept", lease, f"confirmation of trial {lease.trial_number} reported late")
            if body.outcome == "ok" and body.metrics is not None and base_row is not None:
                levels = [lv.model_dump(mode="json") for lv in body.metrics.levels]
                base_levels = base_row.metrics.get("levels", [])
                noise = study_svc.study_noise(s, spec, trials)
                result = confirm.confirm_result(spec, levels, base_levels, noise.variance)
                stored: dict[str, Any] = {
                    **body.model_dump(mode="json"),
                    "confirmation": {
                        **result.as_json(),
                        "baseline_id": base_row.id,
                        "baseline_lease_id": base_row.lease_id,
                        "baseline_measured_at": base_row.measured_at.isoformat(),
                        "baseline_levels": base_levels,
                    },
                }
                end(s, lease, LeaseState.COMPLETED, now, speedup=result.value, result=stored)
                self.health.success(s, lease.worker_id)
            else:
                end(s, lease, LeaseState.FAILED, now, result=body.model_dump(mode="json"))
                failure = body.failure
                reason = "no baseline to pair with" if failure is None else f"{failure.kind}: {failure.message}"
                if failure is not None and (failure.host_fault or failure.kind not in CONFIG_FAILURES):
                    if records.counts_against_host(failure.kind):
                        self.health.failure(s, lease.worker_id, reason)
                    self.retry(s, lease, now, reason)
                else:
                    event(s, "confirm_failed", lease, reason)
            study_svc.maybe_finish(s, spec, now, trials)
            return CompleteOut(lease_id=lease.id, state=lease.state, speedup=lease.speedup)

    def retry(self, s: Session, lease: LeaseRow, now: datetime, reason: str) -> None:
        """Queue a confirmation again (its baseline pairing is redone), up to max_attempts."""
        if lease.attempt >= self.settings.max_attempts:
            event(s, "confirm_given_up", lease, f"{reason}; gave up after {lease.attempt} attempts")
            return
        info = {k: v for k, v in (lease.payload.get("confirm") or {}).items() if k != "baseline_id"}
        s.add(
            LeaseRow(
                id=records.new_lease_id(),
                study_name=lease.study_name,
                kind=LeaseKind.CONFIRM.value,
                state=LeaseState.QUEUED.value,
                worker_id=None,
                trial_number=lease.trial_number,
                attempt=lease.attempt + 1,
                config_key=lease.config_key,
                payload={**lease.payload, "confirm": info},
                created_at=now,
            )
        )
        event(s, "confirm_requeued", lease, f"{reason}; attempt {lease.attempt + 1} queued")
