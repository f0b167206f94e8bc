"""The lease protocol's entry points (docs/leases.md): ask, heartbeat, progress, complete.

Each kind of lease lives in its own module (baseline.py, trial.py, confirm.py), expiry in
expiry.py, and every state change goes through states.py's guarded moves.  Invariants held by the
database, so several API processes can serve one database:
* a worker holds at most one active lease (partial unique index);
* a queued lease is claimed by one worker only (`FOR UPDATE SKIP LOCKED` on Postgres; on SQLite
  the study's file lock and immediate transactions);
* a configuration is launched once per study (unique key in spectune_trial_configs);
* deadlines and timestamps come from the database clock;
* `complete` is idempotent: a repeat returns the stored outcome and changes nothing.
"""

from __future__ import annotations

import itertools
import logging
from datetime import UTC, datetime, timedelta
from typing import NoReturn

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.artifacts import paths_to_names
from api.auth import Principal, require_role, require_worker
from api.context import ServiceContext
from api.db import LOCK_WAIT_MS, REPORT_LOCK_WAIT_MS, db_now, lock_name
from api.errors import BusyError, ConflictError, InvalidInputError, LeaseGoneError
from api.models import LeaseRow, StudyRow, WorkerRow
from api.services import grants, identity, refusals, study_life
from api.services.eligibility import requirements_unmet
from api.services.lease_rows import LeasePayload
from api.services.leasing import plausible, records
from api.services.leasing.baseline import BaselineLeases
from api.services.leasing.confirm import ConfirmLeases
from api.services.leasing.ending import LeaseEnding, study_state
from api.services.leasing.expiry import Expiry
from api.services.leasing.records import HostHealth, lease_out
from api.services.leasing.states import LeaseKind, LeaseState, StudyState, WorkerHoldsLeaseError
from api.services.leasing.trial import TrialLeases
from api.services.report_checks import check_report
from api.services.study_specs import baseline_key_of, running_specs, spec_of, study_trials
from optimizer import study as opt
from optimizer.conductor import Ask, Confirm, MeasureBaseline, RetryLease, Wait
from optimizer.spec import StudySpec
from spectune_protocol import (
    MAX_STANDING_REFUSALS,
    CompleteIn,
    CompleteOut,
    HeartbeatOut,
    Inventory,
    LeaseOut,
    ProgressIn,
    ProgressOut,
    RefusedStudy,
    WorkerStanding,
)
from spectune_protocol.printable import printable

log = logging.getLogger("spectune.api.leasing")


def _line(text: str, limit: int = 255) -> str:
    """One printable line of at most `limit` characters (spectune_protocol's `Plain`)."""
    text = printable(" ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 1] + "…"


class LeaseService:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.health = HostHealth(ctx.settings)
        self.baselines = BaselineLeases(ctx.settings, self.health)
        self.trials = TrialLeases(ctx, self.health)
        self.confirms = ConfirmLeases(ctx, self.health)
        self.expiry = Expiry(ctx, self.health, self.trials, self.confirms)
        self.ending = LeaseEnding(ctx, self.trials, self.confirms)

    def reclaim_expired(self) -> int:
        return self.expiry.reclaim_expired()

    # ------------------------------------------------------------------ asking for work

    def lease(self, principal: Principal, worker_id: str, inventory: Inventory) -> LeaseOut | None:
        require_worker(principal, worker_id)
        with self.ctx.unit() as u, u.step() as s:
            # Before anything is read or written as this worker: the id is this token's, or 403.
            identity.claim(s, principal, worker_id, self.settings.max_worker_ids_per_token)
            now = db_now(s)
            worker = self._touch_worker(s, worker_id, inventory, now)
            current = self._active_lease_of(s, worker_id)
            held = None
            ended = None
            foreign = False
            if current is not None and current.deadline is not None and current.deadline >= now:
                held = (current, current.kind, current.study_name, current.trial_number)
                ended = study_state(s.get(StudyRow, current.study_name))
                foreign = grants.rebound(s, current)
            quarantined = worker.quarantined
        if held is not None and foreign:
            # Handed to a token other than the one this id is bound to now: it ends, never handed on.
            self.ending.end_rebound(held[0].id, held[2], grants.rebound)
            held = None
        elif held is not None and ended is not None:
            # Its study stopped or finished: the lease ends instead of being handed back.
            self.ending.end_with_study(held[0].id, held[2], ended)
            held = None
        if held is not None:
            lease, kind, study, number = held
            if kind != LeaseKind.TRIAL or number is None or self._trial_running(study, number):
                # A worker asking again while it holds a live lease (it restarted) gets it back.
                return lease_out(lease, self.settings)
            # Its trial finished behind its back: the lease ends here and is never handed out again.
            self.trials.supersede(lease.id, f"trial {number} was already finished when its worker asked again")
        self.reclaim_expired()
        if quarantined:
            return None
        # Oldest study first, each study's lock taken only if free now: a worker never queues
        # behind another request working on one study (every worker used to wait on the oldest
        # study's lock, lease p50 5 s with 100 studies) but moves on to the next.  Only when no
        # free study had work for it does it wait, oldest first, for the busy ones: with one
        # running study every worker still gets its turn instead of "no work now".
        busy: list[StudySpec] = []
        # Studies that would have this worker measure a confirmation's baseline ahead of time
        # (optimizer.conductor.ready_baseline): asked again, in order, only when no study has
        # other work for it, so a worker is never kept from one study's search by another's guess
        # (a study still busy after the wait may have had some: then the worker hears 204).
        spare: list[StudySpec] = []
        unheard: list[StudySpec] = []  # still busy when waited for: they may have had work
        passes = itertools.chain(
            ((spec, 0, False) for spec in self._candidate_studies(inventory, worker_id)),
            ((spec, LOCK_WAIT_MS, False) for spec in busy),  # read once the first pass is over
            ((spec, LOCK_WAIT_MS, True) for spec in spare if not unheard),
        )
        for spec, wait_ms, is_spare in passes:
            try:
                out = self._lease_from_study(spec, worker_id, wait_ms, spare=is_spare, spare_for=spare)
            except BusyError:
                if wait_ms == 0 and not is_spare:
                    busy.append(spec)
                else:
                    if not is_spare:
                        unheard.append(spec)
                    # Many workers queue on this study right now: try the next one, or say "no
                    # work now" (204); the worker asks again after its idle back-off.
                    log.info("study %s busy; worker %s tries elsewhere", spec.name, worker_id)
                continue
            except WorkerHoldsLeaseError:
                # The same worker asked twice at once and the other request won: the lease it
                # holds is the answer to both.
                with self.ctx.sessions() as s:
                    won = self._active_lease_of(s, worker_id)
                return None if won is None else lease_out(won, self.settings)
            if out is not None:
                return out
        return None

    def standing(self, worker_id: str) -> WorkerStanding:
        """What the fleet decided about this worker, sent with its lease answer so its own log
        says it: quarantined (and why), and the open studies it is not offered as it refused them.
        Texts are made one printable line each (they are logged on the host)."""
        with self.ctx.sessions() as s:
            row = s.get(WorkerRow, worker_id)
            refused = refusals.active_refusals(s, worker_id=worker_id, open_studies=True)
            reason = None if row is None or not row.quarantined else row.quarantine_reason or "quarantined"
            return WorkerStanding(
                quarantined=None if reason is None else _line(reason),
                refused=[
                    RefusedStudy(study=str(e.study_name), reason=_line(paths_to_names(e.detail or "")))
                    for e in refused[-MAX_STANDING_REFUSALS:]
                ],
            )

    def _trial_running(self, study: str, number: int) -> bool:
        with self.ctx.sessions() as s:
            spec = spec_of(s, study)
        return not opt.get_trial(opt.load_study(self.ctx.storage, spec), number).state.is_finished()

    def _touch_worker(self, s: Session, worker_id: str, inv: Inventory, now: datetime) -> WorkerRow:
        row = s.get(WorkerRow, worker_id)
        if row is None:
            row = WorkerRow(
                id=worker_id,
                inventory=inv.model_dump(mode="json"),
                first_seen=now,
                last_seen=now,
                consecutive_host_failures=0,
                quarantined=False,
            )
            try:
                # Added inside the savepoint: begin_nested() flushes what is pending first, so a
                # row added before it would be inserted outside the savepoint, and the unique
                # violation would roll back the caller's step (500 "closed transaction").
                with s.begin_nested():
                    s.add(row)
                    s.flush()
            except IntegrityError:  # registered by a concurrent request of the same worker
                row = s.get(WorkerRow, worker_id, populate_existing=True)
                assert row is not None
        before = (row.inventory or {}).get("config_digest")
        if inv.config_digest is not None and before != inv.config_digest:
            # Its allowlist, registry or prompt files changed: what it refused may run now.
            refusals.clear_refusals(
                s, worker_id, f"the worker's config changed (digest {before} -> {inv.config_digest})"
            )
        row.inventory = inv.model_dump(mode="json")
        row.last_seen = now
        return row

    @staticmethod
    def _active_lease_of(s: Session, worker_id: str) -> LeaseRow | None:
        return s.scalars(
            select(LeaseRow).where(LeaseRow.worker_id == worker_id, LeaseRow.state == LeaseState.ACTIVE)
        ).first()

    def _candidate_studies(self, inv: Inventory, worker_id: str) -> list[StudySpec]:
        with self.ctx.sessions() as s:
            specs = running_specs(s)
            refused = {e.study_name for e in refusals.active_refusals(s, worker_id=worker_id)}
        out = []
        inventory = inv.model_dump(mode="json")
        for spec in specs:
            if spec.name in refused:
                continue
            # Models, placement labels, GPU count: the same test `GET /v1/studies/{name}` warns with.
            if requirements_unmet(spec, inventory):
                continue
            out.append(spec)
        return out

    def _lease_from_study(
        self, spec: StudySpec, worker_id: str, wait_ms: int, *, spare: bool, spare_for: list[StudySpec]
    ) -> LeaseOut | None:
        """Carry out the conductor's next action for this worker (api.services.study_life asks it);
        BusyError when the study's lock is not had within `wait_ms`.  `spare`: no other study had
        work for the worker; a study that would give a spare worker a baseline is added to
        `spare_for`."""
        with self.ctx.unit(lock=f"study:{spec.name}", wait_ms=wait_ms) as u:
            # Read before the write step (SQLite: Optuna must not wait for our write lock).
            trials = study_trials(self.ctx.storage, self.ctx.sessions, spec.name)
            with u.step() as s:
                now = db_now(s)
                action = study_life.next_for(s, spec, worker_id, now, trials, self.settings, spare=spare)
                if isinstance(action, Wait) and action.spare_baseline:
                    spare_for.append(spec)
                lease: LeaseRow | None = None
                if isinstance(action, MeasureBaseline):
                    lease = self.baselines.new(s, spec, worker_id, now)
                elif isinstance(action, RetryLease):
                    lease = self.trials.claim_retry(s, action.lease_id, worker_id, now)
                elif isinstance(action, Confirm):
                    lease = self.confirms.claim(s, spec, action, now, trials)
                if lease is not None:
                    return lease_out(lease, self.settings)
            if not isinstance(action, Ask):
                return None  # Wait, Finish (persisted), or a lease another request took meanwhile
            return self.trials.ask_new(u, spec, worker_id)

    # ------------------------------------------------------------------ heartbeat / progress

    def _owned(self, s: Session, principal: Principal, lease_id: str, *, for_update: bool = True) -> LeaseRow:
        # The role first (403 for a user or admin token); then "no such lease" and "not this
        # token's lease" get one answer, so a worker token learns nothing of others' leases.
        require_role(principal, "worker")
        q = select(LeaseRow).where(LeaseRow.id == lease_id)
        if for_update:
            q = q.with_for_update()
        lease = s.scalars(q).first()
        if lease is None or not grants.may_act(s, principal, lease):
            raise grants.not_yours(lease_id)
        return lease

    @staticmethod
    def _require_live(lease: LeaseRow, now: datetime) -> None:
        if lease.state == LeaseState.EXPIRED or (
            lease.state == LeaseState.ACTIVE and lease.deadline is not None and lease.deadline < now
        ):
            raise LeaseGoneError(f"lease {lease.id} expired and was reclaimed; stop this work")
        if lease.state != LeaseState.ACTIVE:
            raise ConflictError(f"lease {lease.id} is {lease.state}; stop this work")

    def _study_ended(self, lease_id: str, study: str, state: StudyState) -> NoReturn:
        """End a lease whose study stopped or finished (ended_study.py) and answer 409, on which
        the worker cancels its work and stops the engine.  Called outside the unit that read the
        lease: the lease ends under the study's lock, taken before any row."""
        self.ending.end_with_study(lease_id, study, state)
        raise ConflictError(f"study {study!r} is {state}: lease {lease_id} has ended; stop this work")

    def _end_if_rebound(self, principal: Principal, lease_id: str) -> None:
        """A lease whose worker id was bound to another token since it was granted ends here
        (grants.rebound); the token it was granted to hears 409 (it stops the engine), any other
        token then gets the usual 404 from `_owned`."""
        if principal.role != "worker":
            return
        with self.ctx.sessions() as s:
            lease = s.get(LeaseRow, lease_id)
            if lease is None or lease.state != LeaseState.ACTIVE or not grants.rebound(s, lease):
                return
            mine = grants.granted_to(s, principal, lease)
            study, worker_id = lease.study_name, lease.worker_id
        self.ending.end_rebound(lease_id, study, grants.rebound)
        if mine:
            raise ConflictError(
                f"worker id {worker_id!r} is now bound to another token: lease {lease_id} has ended; stop this work"
            )

    def heartbeat(self, principal: Principal, lease_id: str) -> HeartbeatOut:
        self._end_if_rebound(principal, lease_id)
        with self.ctx.unit() as u, u.step() as s:
            now = db_now(s)
            lease = self._owned(s, principal, lease_id)
            self._require_live(lease, now)
            ended = study_state(s.get(StudyRow, lease.study_name))
            study = lease.study_name
            if ended is None:
                lease.deadline = now + timedelta(seconds=self.settings.lease_ttl_s)
                records.touch_seen(s, lease.worker_id, now)
                return HeartbeatOut(deadline=lease.deadline.replace(tzinfo=UTC))
        self._study_ended(lease_id, study, ended)

    def progress(self, principal: Principal, lease_id: str, body: ProgressIn) -> ProgressOut:
        self._end_if_rebound(principal, lease_id)
        with self.ctx.unit() as u:
            with u.step() as s:
                now = db_now(s)
                lease = self._owned(s, principal, lease_id)
                self._require_live(lease, now)
                ended = study_state(s.get(StudyRow, lease.study_name))
                if ended is not None:
                    study = lease.study_name
                else:
                    lease.deadline = now + timedelta(seconds=self.settings.lease_ttl_s)
                    if lease.kind != LeaseKind.TRIAL or lease.trial_number is None or lease.worker_id is None:
                        return ProgressOut(action="continue")
                    spec = spec_of(s, lease.study_name)
                    base_row = records.latest_baseline(s, lease.worker_id, baseline_key_of(spec))
                    base = None if base_row is None else records.baseline_tok_s(base_row)
                    number = lease.trial_number
        if ended is not None:
            self._study_ended(lease_id, study, ended)
        if base is None or body.concurrency not in base or base[body.concurrency] <= 0:
            return ProgressOut(action="continue")
        if spec.objective.name != "throughput":
            # Progress carries output tok/s only: a trial is pruned only on the throughput objective.
            return ProgressOut(action="continue")
        return self.trials.progress(spec, lease_id, number, body, body.output_tok_s / base[body.concurrency])

    # ------------------------------------------------------------------ complete

    def complete(self, principal: Principal, lease_id: str, body: CompleteIn) -> CompleteOut:
        if body.outcome == "ok" and body.metrics is None:
            raise InvalidInputError("metrics: an ok outcome needs metrics", field="metrics")
        if body.outcome == "failed" and body.failure is None:
            raise InvalidInputError("failure: a failed outcome needs a failure with kind and message", field="failure")
        self._end_if_rebound(principal, lease_id)
        with self.ctx.sessions() as s:
            seen = self._owned(s, principal, lease_id, for_update=False)
            if seen.state in (LeaseState.COMPLETED, LeaseState.FAILED):
                # A repeat (the worker's outbox resends until it hears back): no lock to wait for.
                return CompleteOut(lease_id=seen.id, state=seen.state, speedup=seen.speedup, duplicate=True)
            study = seen.study_name
        # The study's lock before anything is locked or written: the report ends by settling the
        # study (its row FOR UPDATE), and a lease of the same study takes that lock and row first;
        # rows held while waiting for the row deadlocked on Postgres.  Then the lease's lock, in
        # that order everywhere: a repeat of this report queued on the lease's lock behind one
        # queued on the study's (10 s against 30 s) and was answered 503.
        with self.ctx.unit(lock=f"study:{study}", wait_ms=REPORT_LOCK_WAIT_MS) as u:
            with u.step() as s:
                lock_name(s, f"lease:{lease_id}", REPORT_LOCK_WAIT_MS)
                lease = self._owned(s, principal, lease_id)
                if lease.state in (LeaseState.COMPLETED, LeaseState.FAILED):
                    return CompleteOut(lease_id=lease.id, state=lease.state, speedup=lease.speedup, duplicate=True)
                if lease.state in (LeaseState.QUEUED, LeaseState.SUPERSEDED):
                    raise ConflictError(f"lease {lease.id} is {lease.state}; this report is not expected")
                check_report(lease.kind, LeasePayload.of(lease), body)
                late = lease.state == LeaseState.EXPIRED
                spec = spec_of(s, lease.study_name)
                kind = lease.kind
                # Which token reported it: independence is judged by token (issue 35).
                lease.token_id = principal.token_id
                # Plausibility before trust: an impossible report is a host fault, never scored.
                problem = plausible.judge(s, spec, lease, body, db_now(s))
                original = body
                if problem is not None:
                    records.event(s, plausible.IMPLAUSIBLE, lease, problem[:2000])
                    log.warning("worker %s: implausible report on lease %s: %s", lease.worker_id, lease.id, problem)
                    body = plausible.quarantined(problem)
                if body.failure is not None and body.failure.kind == "refused":
                    # A study fault: this worker is not offered the study again (_candidate_studies).
                    # Shown to users in the study's `refused_by`: names, not the host's paths.
                    records.event(s, refusals.LEASE_REFUSED, lease, paths_to_names(body.failure.message)[:2000])
                    log.warning("worker %s refused lease %s of study %s: %s", lease.worker_id, lease.id,
                                lease.study_name, body.failure.message)  # fmt: skip
            if kind == LeaseKind.BASELINE:
                out = self.baselines.complete(u, spec, lease_id, body, late)
            elif kind == LeaseKind.CONFIRM:
                out = self.confirms.complete(u, spec, lease_id, body, late)
            else:
                out = self.trials.complete(u, spec, lease_id, body, late)
            if problem is not None:
                with u.step() as s:
                    plausible.keep_original(s, lease_id, original, problem)
            return out
