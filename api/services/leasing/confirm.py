"""Confirmation leases: the best candidates re-measured, each next to a fresh baseline.

Queued by the conductor (optimizer.conductor, persisted by api.services.study_life) once the
search is over; which worker confirms which candidate, and with which baseline, is the
conductor's `Confirm` (or a `MeasureBaseline` first).  This module claims, completes and retries.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from optuna.trial import FrozenTrial
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.context import ServiceContext, Unit
from api.db import db_now
from api.models import BaselineRow, LeaseRow
from api.services import study_life
from api.services.launch_noise import study_noise
from api.services.lease_rows import LeasePayload
from api.services.leasing import records
from api.services.leasing.records import CONFIG_FAILURES, HostHealth, event
from api.services.leasing.sql_store import SqlStudyStore, lease_record
from api.services.leasing.states import LeaseKind, LeaseState, end
from api.services.study_specs import baseline_key_of, study_trials
from optimizer import actions
from optimizer import attrs as A
from optimizer import confirmation as confirm
from optimizer.conductor import Confirm
from optimizer.spec import StudySpec
from spectune_protocol import CompleteIn, CompleteOut

log = logging.getLogger("spectune.api.leasing")


class ConfirmLeases:
    def __init__(self, ctx: ServiceContext, health: HostHealth) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.health = health

    def claim(
        self, s: Session, spec: StudySpec, action: Confirm, now: datetime, trials: Sequence[FrozenTrial] = ()
    ) -> LeaseRow | None:
        """The conductor's `Confirm`: the queued confirmation, now active for its worker and paired
        with the baseline the conductor chose, in the deployment optimizer.actions.claim_confirm
        names (None when another request took it meanwhile, or no envelope is left to launch)."""
        lease = s.get(LeaseRow, action.lease_id, with_for_update=True)
        if lease is None or lease.state != LeaseState.QUEUED:
            return None
        store = SqlStudyStore(self.ctx, spec, session=s)
        if not actions.claim_confirm(store, lease_record(lease), action, now, trials):
            return None
        log.info(
            "lease %s: study %s confirms trial %s on %s", lease.id, spec.name, lease.trial_number, action.worker_id
        )
        return lease

    def complete(self, u: Unit, spec: StudySpec, lease_id: str, body: CompleteIn, late: bool) -> CompleteOut:
        """A candidate re-measured: its speedup and interval against the baseline paired with it."""
        trials = study_trials(self.ctx.storage, self.ctx.sessions, spec.name)
        with u.step() as s:
            now = db_now(s)
            lease = s.get(LeaseRow, lease_id)
            assert lease is not None and lease.worker_id is not None
            payload = LeasePayload.of(lease)
            info = payload.confirm_info
            key = baseline_key_of(spec)
            base_row = s.get(BaselineRow, info.baseline_id) if info.baseline_id is not None else None
            # Only the baseline the conductor paired it with is called fresh.
            fresh = base_row is not None and bool(info.baseline_fresh)
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
                noise = study_noise(s, spec, trials)
                result = confirm.confirm_result(spec, levels, base_levels, noise.variance)
                stored: dict[str, Any] = {
                    **body.model_dump(mode="json"),
                    "confirmation": {
                        **result.as_json(),
                        "baseline_id": base_row.id,
                        "baseline_lease_id": base_row.lease_id,
                        "baseline_measured_at": base_row.measured_at.isoformat(),
                        "baseline_fresh": fresh,
                        "baseline_levels": base_levels,
                        # Why this launch is no independent confirmation, or None (issue 35).
                        "not_independent": not_independent(s, lease, base_row, trials),
                    },
                    # The server this launch started: the deployment it proves (issue 17 item 1).
                    "deployment": {
                        "tier": info.tier,
                        "note": info.envelope_note or "",
                        "server": payload.server.model_dump(mode="json"),
                        "adaptive": bool(info.adaptive),
                    },
                }
                end(s, lease, LeaseState.COMPLETED, now, speedup=result.value, result=stored)
                self.health.success(s, lease.worker_id)
            else:
                end(s, lease, LeaseState.FAILED, now, result=body.model_dump(mode="json"))
                failure = body.failure
                if failure is None:
                    event(s, "confirm_failed", lease, "no baseline to pair with")
                else:
                    if (failure.host_fault or failure.kind not in CONFIG_FAILURES) and records.counts_against_host(
                        failure.kind
                    ):
                        self.health.failure(s, lease.worker_id, f"{failure.kind}: {failure.message}")
                    # Retried, the next envelope, or out (optimizer.actions.confirm_failed).
                    actions.confirm_failed(
                        SqlStudyStore(self.ctx, spec, session=s),
                        lease_record(lease),
                        now,
                        failure.kind,
                        failure.message,
                        host_fault=failure.host_fault,
                        max_attempts=self.settings.max_attempts,
                        trials=trials,
                    )
            study_life.settle(s, spec, now, trials, self.settings)
            return CompleteOut(lease_id=lease.id, state=lease.state, speedup=lease.speedup)

    def retry(self, s: Session, lease: LeaseRow, now: datetime, reason: str) -> None:
        """Queue a confirmation again (its baseline pairing is redone), up to max_attempts."""
        store = SqlStudyStore(self.ctx, lease.study_name, session=s)
        actions.retry_confirm(store, lease_record(lease), now, reason, self.settings.max_attempts)


def not_independent(s: Session, lease: LeaseRow, base_row: BaselineRow, trials: Sequence[FrozenTrial]) -> str | None:
    """Why this confirmation does not vouch for its candidate independently, or None when it does.

    It counts only when another token *and* another worker id than the search launch's measured
    it, next to a baseline its own token reported: one stolen unbound token once found a forged
    candidate as `liar-1` and confirmed it as `liar-2` (issue 35).  Leases from before migration
    0007 carry no token; then the worker ids alone decide.
    """
    base_lease = s.get(LeaseRow, base_row.lease_id)
    base_token = None if base_lease is None else base_lease.token_id
    if base_token != lease.token_id or base_row.worker_id != lease.worker_id:
        return "its baseline was reported by another token or host than the confirmation"
    if lease.trial_number is None:
        return None  # the adaptive proof: several trials' chains, found by no one host
    found = next((t for t in trials if t.number == lease.trial_number), None)
    record = None if found is None else A.TrialRecord(found)
    finder = None if record is None else record.worker_id
    trial_lease = None if record is None or record.lease_id is None else s.get(LeaseRow, record.lease_id)
    finder_token = None if trial_lease is None else trial_lease.token_id
    if finder_token is not None and finder_token == lease.token_id:
        return "re-measured only by the worker token that found it (one token serves this study)"
    if finder == lease.worker_id:
        return "re-measured only on the host that found it"
    return None
