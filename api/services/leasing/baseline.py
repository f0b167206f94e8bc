"""Baseline leases: the same server without speculation, measured on each host before its trials.

A worker gets a baseline lease for a study when the conductor says so (optimizer.conductor
`MeasureBaseline`): it has no baseline for the study's baseline key younger than
`baseline_max_age_s` (so drift does not pose as speedup), or a confirmation needs a fresh one.

A baseline that fails for what the *study* asks (out of memory with its `mem_fraction_static`, a
value of its `extra_args` the engine rejects, a start-up that cannot finish) is charged to the
study, never to the host (issue 18: three such failures quarantined a worker in 6 s, and the same
baseline was handed out again each time).  See `BaselineLeases.charge_study`.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.context import Unit
from api.db import db_now
from api.models import BaselineRow, EventRow, LeaseRow
from api.services import lease_rows, refusals, study_life
from api.services.leasing.records import CONFIG_FAILURES, HostHealth, counts_against_host, event
from api.services.leasing.states import LeaseKind, LeaseState, end
from api.services.study_specs import baseline_key_of, stored_verify_probe
from api.settings import Settings
from optimizer import conductor
from optimizer.spec import StudySpec
from spectune_protocol import CompleteIn, CompleteOut, Failure, VerifyProbe

# Event kind of a baseline that failed for what its study asks (charge_study).
BASELINE_STUDY_FAULT = "baseline_study_fault"


def is_study_fault(failure: Failure) -> bool:
    """Did the study's own settings make the server or its benchmark fail (not the host, not the
    worker)?  `request_rejected`: the engine answered the study's own requests with HTTP 4xx."""
    return (failure.kind in CONFIG_FAILURES or failure.kind == "request_rejected") and not failure.host_fault


def fault_from_spec(spec: StudySpec, failure: Failure) -> str | None:
    """The spec's own proof of a rejected request, in the service's words, or None.

    Only what the service can check itself counts: a worker's word that the engine refused a
    value is not proof (one token's forged report once stopped other users' studies, issue 35).
    """
    if failure.kind != "request_rejected" or failure.spec_field not in ("workload.input_len", "workload.output_len"):
        return None
    w, context = spec.workload, spec.model.context_length
    if context is None or w.input_len is None or w.input_len + w.output_len <= context:
        return None
    return (
        f"workload.input_len {w.input_len} + workload.output_len {w.output_len} exceed model.context_length "
        f"{context}: lower them or raise model.context_length"
    )


def verify_probe_of(row: BaselineRow) -> VerifyProbe | None:
    """The verify probe stored with a baseline (in its metrics, as reported), or None
    (api.services.study_specs.stored_verify_probe: the conductor's snapshot reads it there)."""
    return stored_verify_probe(row.metrics)


class BaselineLeases:
    def __init__(self, settings: Settings, health: HostHealth) -> None:
        self.settings = settings
        self.health = health

    def new(self, s: Session, spec: StudySpec, worker_id: str, now: datetime) -> LeaseRow | None:
        """A baseline lease, active for `worker_id`; None when the worker got another one meanwhile."""
        lease = lease_rows.new_lease_row(
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
                        baseline_key=baseline_key_of(spec),
                        lease_id=lease.id,
                        measured_at=now,
                        tok_s={str(lv.concurrency): lv.output_tok_s for lv in body.metrics.levels},
                        metrics=body.metrics.model_dump(mode="json"),
                    )
                )
                self.health.success(s, lease.worker_id)
            else:
                assert body.failure is not None
                if is_study_fault(body.failure):
                    self.charge_study(s, spec, lease, body.failure, now)
                elif counts_against_host(body.failure.kind):
                    reason = f"baseline failed: {body.failure.kind}: {body.failure.message}"
                    self.health.failure(s, lease.worker_id, reason)
            if late:
                event(s, "late_report_kept", lease, "baseline reported after its lease expired")
            return CompleteOut(lease_id=lease.id, state=lease.state)

    def charge_study(self, s: Session, spec: StudySpec, lease: LeaseRow, failure: Failure, now: datetime) -> None:
        """A baseline failed for what its study asks: the study pays, the host does not.

        * When the same baseline (same server settings and workload) was measured on another host,
          the settings do run: the fault follows this host, and counts against it as any other.
        * Otherwise the study is not offered to this worker again (a refusal, listed under
          `refused_by` with the reason; it ends when the worker's config changes or an admin
          clears it), and it is stopped, saying why, once its baseline failed so on two hosts
          with their own worker tokens, or at once where the spec itself proves the fault
          (`fault_from_spec`; optimizer.conductor.baseline_fault).  The host's health is untouched.  (Two broken studies in a row on one host once looked like a sick
          host: what the settings did elsewhere is the evidence, not how many failed here.)
        """
        worker_id = lease.worker_id
        assert worker_id is not None
        detail = f"the study's baseline failed on this host: {failure.kind}: {failure.message}"[:2000]
        ran_elsewhere = s.scalars(
            select(BaselineRow.id)
            .where(BaselineRow.baseline_key == baseline_key_of(spec), BaselineRow.worker_id != worker_id)
            .limit(1)
        ).first()
        if ran_elsewhere is not None:
            reason = f"baseline failed where the same settings ran on another host: {failure.kind}: {failure.message}"
            self.health.failure(s, worker_id, reason)
            return
        event(s, BASELINE_STUDY_FAULT, lease, detail)
        event(s, refusals.LEASE_REFUSED, lease, detail)
        s.flush()
        # Hosts are counted by token: one token's many worker ids are one witness (issue 35).
        hosts = {
            token if token is not None else f"worker:{worker}"
            for worker, token in s.execute(
                select(EventRow.worker_id, LeaseRow.token_id)
                .join(LeaseRow, LeaseRow.id == EventRow.lease_id, isouter=True)
                .where(EventRow.kind == BASELINE_STUDY_FAULT, EventRow.study_name == spec.name)
            )
        }
        ending = conductor.baseline_fault(failure.kind, failure.message, len(hosts), fault_from_spec(spec, failure))
        if ending is not None and study_life.stop_for_fault(s, spec, ending, now):
            event(s, "study_stopped_by_its_fault", lease, ending.detail)
