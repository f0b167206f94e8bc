"""The lease protocol (design.md "Leases"): hand out work, keep it alive, take the results.

Invariants, each enforced by the database so several API processes can serve one database:
* a worker holds at most one active lease (partial unique index);
* a queued retry is claimed by one worker only (`FOR UPDATE SKIP LOCKED` on Postgres, SQLite
  serialises writers);
* a configuration is launched once per study (unique key in spectune_trial_configs);
* deadlines and timestamps come from the database clock;
* `complete` is idempotent: a repeat returns the stored outcome and changes nothing.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import optuna
from optuna.trial import TrialState
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.artifacts import store_trial_artifacts
from api.auth import Principal, require_worker
from api.context import ServiceContext
from api.db import db_now
from api.errors import BusyError, ConflictError, ForbiddenError, LeaseGoneError, NotFoundError
from api.models import BaselineRow, EventRow, LeaseRow, StudyRow, TrialConfigRow, WorkerRow
from api.protocol import CompleteIn, CompleteOut, HeartbeatOut, Inventory, LeaseOut, ProgressIn, ProgressOut
from api.services import studies as study_svc
from optimizer import confirmation as confirm
from optimizer import pruning
from optimizer import study as opt
from optimizer.errors import TrialStateError
from optimizer.infeasible import known_to_fail, oom_points
from optimizer.objective import CONSTRAINT_KEY, LevelResult, score
from optimizer.plan import server_settings
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec

log = logging.getLogger("spectune.api.leasing")

# Proposals that turn out to be a configuration already launched are answered without a launch;
# bound the loop so a nearly exhausted space cannot spin.
MAX_DUPLICATE_PROPOSALS = 12
# Failure kinds caused by the configuration itself: taught to the sampler as infeasible.
CONFIG_FAILURES = frozenset({"invalid_config", "oom", "launch_timeout"})


@dataclass(frozen=True)
class _Claim:
    lease: LeaseRow


class LeaseService:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.settings = ctx.settings

    # ------------------------------------------------------------------ leasing

    def lease(self, principal: Principal, worker_id: str, inventory: Inventory) -> LeaseOut | None:
        require_worker(principal, worker_id)
        with self.ctx.unit() as u, u.step() as s:
            now = db_now(s)
            worker = self._touch_worker(s, worker_id, inventory, now)
            current = self._active_lease_of(s, worker_id)
            if current is not None and current.deadline is not None and current.deadline >= now:
                return self._lease_out(current)
            quarantined = worker.quarantined
        self.reclaim_expired()
        if quarantined:
            return None
        for study in self._candidate_studies(inventory):
            try:
                out = self._lease_from_study(study, worker_id)
            except BusyError:
                # Many workers queue on this study right now: try the next one, or say "no work
                # now" (204); the worker asks again after its idle back-off.
                log.info("study %s busy; worker %s tries elsewhere", study.name, worker_id)
                continue
            if out is not None:
                return out
        return None

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
            s.add(row)
            try:
                s.flush()
            except IntegrityError:  # registered by a concurrent request of the same worker
                s.rollback()
                row = s.get(WorkerRow, worker_id)
                assert row is not None
        row.inventory = inv.model_dump(mode="json")
        row.last_seen = now
        return row

    @staticmethod
    def _active_lease_of(s: Session, worker_id: str) -> LeaseRow | None:
        return s.scalars(select(LeaseRow).where(LeaseRow.worker_id == worker_id, LeaseRow.state == "active")).first()

    def _candidate_studies(self, inv: Inventory) -> list[StudySpec]:
        with self.ctx.sessions() as s:
            rows = s.scalars(
                select(StudyRow).where(StudyRow.state == "running").order_by(StudyRow.created_at, StudyRow.name)
            ).all()
        out = []
        models = set(inv.models)
        for row in rows:
            spec = StudySpec.model_validate(row.spec)
            if any(inv.labels.get(k) != v for k, v in spec.placement.items()):
                continue
            if spec.model.target not in models or spec.model.draft not in models:
                continue
            out.append(spec)
        return out

    def _lease_from_study(self, spec: StudySpec, worker_id: str) -> LeaseOut | None:
        key = study_svc.baseline_key_of(spec)
        with self.ctx.unit(lock=f"study:{spec.name}") as u:
            with u.step() as s:
                now = db_now(s)
                row = s.get(StudyRow, spec.name)
                if row is None or row.state != "running":
                    return None
                if not self._has_fresh_baseline(s, worker_id, key, now):
                    lease = self._new_lease(s, spec, "baseline", worker_id, now, config=None, number=None)
                    return None if lease is None else self._lease_out(lease)
                claimed = self._claim_queued(s, spec.name, worker_id, now)
                if claimed is not None:
                    return self._lease_out(claimed)
                confirming = study_svc.confirming(s, spec.name)
                if not confirming and self._budget_reason(s, spec, row, now) is not None:
                    # Finishing may start the confirmation of the best candidates instead.
                    study_svc.maybe_finish(s, spec, now, self.ctx.storage)
                    confirming = study_svc.confirming(s, spec.name)
                    if not confirming:
                        return None
                if confirming:
                    lease = self._confirm_lease(s, spec, worker_id, key, now)
                    return None if lease is None else self._lease_out(lease)
            return self._ask_new(u, spec, worker_id)

    def _confirm_lease(self, s: Session, spec: StudySpec, worker_id: str, key: str, now: datetime) -> LeaseRow | None:
        """A queued confirmation for this worker, preceded by a fresh baseline on the same host.

        The pairing: a confirm lease is handed to a worker only when its latest baseline was
        measured after the confirmation began and after its previous confirmation ended, i.e.
        right before; otherwise the worker gets that baseline lease first.  A candidate is
        confirmed on another worker than the one that measured it, when another one is alive.
        """
        queued = s.scalars(
            select(LeaseRow)
            .where(LeaseRow.study_name == spec.name, LeaseRow.kind == "confirm", LeaseRow.state == "queued")
            .order_by(LeaseRow.created_at, LeaseRow.trial_number)
            .with_for_update(skip_locked=True)
        ).all()
        for lease in queued:
            avoid = (lease.payload.get("confirm") or {}).get("avoid_worker")
            if avoid == worker_id and self._another_capable_worker(s, key, worker_id, now):
                continue
            base = self._baseline(s, worker_id, key)
            if base is None or base.measured_at < self._confirm_pairing_since(s, spec.name, worker_id):
                return self._new_lease(s, spec, "baseline", worker_id, now, config=None, number=None)
            lease.state = "active"
            lease.worker_id = worker_id
            lease.leased_at = now
            lease.deadline = now + timedelta(seconds=self.settings.lease_ttl_s)
            info = dict(lease.payload.get("confirm") or {})
            info["baseline_id"] = base.id
            lease.payload = {**lease.payload, "confirm": info}
            try:
                with s.begin_nested():
                    s.flush()
            except IntegrityError as e:  # the worker got another lease concurrently
                raise ConflictError("this worker already holds an active lease; ask again") from e
            log.info("lease %s: study %s confirms trial %s on %s", lease.id, spec.name, lease.trial_number, worker_id)
            return lease
        return None

    @staticmethod
    def _confirm_pairing_since(s: Session, study: str, worker_id: str) -> datetime:
        started = s.scalar(
            select(func.min(LeaseRow.created_at)).where(LeaseRow.study_name == study, LeaseRow.kind == "confirm")
        )
        last = s.scalar(
            select(func.max(LeaseRow.finished_at)).where(
                LeaseRow.study_name == study, LeaseRow.kind == "confirm", LeaseRow.worker_id == worker_id
            )
        )
        assert started is not None
        return max(started, last) if last is not None else started

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

    def _has_fresh_baseline(self, s: Session, worker_id: str, key: str, now: datetime) -> bool:
        since = now - timedelta(seconds=self.settings.baseline_max_age_s)
        found = s.scalars(
            select(BaselineRow.id).where(
                BaselineRow.worker_id == worker_id, BaselineRow.baseline_key == key, BaselineRow.measured_at >= since
            )
        ).first()
        return found is not None

    def _claim_queued(self, s: Session, study: str, worker_id: str, now: datetime) -> LeaseRow | None:
        q = (
            select(LeaseRow)
            .where(LeaseRow.study_name == study, LeaseRow.state == "queued", LeaseRow.kind == "trial")
            .order_by(LeaseRow.created_at)
            .limit(1)
            .with_for_update(skip_locked=True)
        )
        lease = s.scalars(q).first()
        if lease is None:
            return None
        lease.state = "active"
        lease.worker_id = worker_id
        lease.leased_at = now
        lease.deadline = now + timedelta(seconds=self.settings.lease_ttl_s)
        try:
            s.flush()
        except IntegrityError as e:  # the worker got another lease concurrently
            raise ConflictError("this worker already holds an active lease; ask again") from e
        return lease

    def _new_lease(
        self,
        s: Session,
        spec: StudySpec,
        kind: str,
        worker_id: str | None,
        now: datetime,
        *,
        config: SpecConfig | None,
        number: int | None,
        attempt: int = 1,
    ) -> LeaseRow | None:
        settings = server_settings(spec, config)
        lease = LeaseRow(
            id=str(uuid.uuid4()),
            study_name=spec.name,
            kind=kind,
            state="active" if worker_id is not None else "queued",
            worker_id=worker_id,
            trial_number=number,
            attempt=attempt,
            config_key=None if config is None else config.key,
            payload={
                "server": settings.model_dump(mode="json"),
                "workload": spec.workload.model_dump(mode="json"),
                "config": None if config is None else config.model_dump(mode="json"),
            },
            created_at=now,
            leased_at=now if worker_id is not None else None,
            deadline=now + timedelta(seconds=self.settings.lease_ttl_s) if worker_id is not None else None,
        )
        s.add(lease)
        try:
            with s.begin_nested():
                s.flush()
        except IntegrityError:
            # Only the one-active-lease-per-worker index can fire here: a concurrent request of
            # the same worker won; it will be handed that lease when it asks again.
            s.expunge(lease)
            return None
        return lease

    @staticmethod
    def _launched(s: Session, study: str) -> int:
        return s.scalar(select(func.count()).select_from(TrialConfigRow).where(TrialConfigRow.study_name == study)) or 0

    def _budget_reason(self, s: Session, spec: StudySpec, row: StudyRow, now: datetime) -> str | None:
        launched = self._launched(s, spec.name)
        if launched >= spec.budget.max_trials:
            return f"budget used: {launched} of max_trials={spec.budget.max_trials} configurations launched"
        if spec.budget.max_hours is not None and now - row.created_at > timedelta(hours=spec.budget.max_hours):
            return f"budget used: max_hours={spec.budget.max_hours} passed"
        return None

    def _ask_new(self, u: Any, spec: StudySpec, worker_id: str) -> LeaseOut | None:
        storage = self.ctx.storage
        for _ in range(MAX_DUPLICATE_PROPOSALS):
            study = opt.load_study(storage, spec)
            asked = opt.ask(study, spec)
            proof = known_to_fail(asked.config, oom_points(study.get_trials(deepcopy=False)))
            if proof is not None:
                # Needs at least the memory of a configuration that ran out of it: no launch.
                opt.tell_infeasible(
                    study,
                    asked.number,
                    {
                        "inferred_from": proof.trial_number,
                        "failure_kind": "oom",
                        "failure_message": f"not launched: needs at least the GPU memory of trial "
                        f"{proof.trial_number} ({proof.config.key}), which ran out of memory",
                    },
                )
                log.info("study %s trial %d %s: skipped, known to run out of memory (trial %d)",
                         spec.name, asked.number, asked.config.key, proof.trial_number)  # fmt: skip
                continue
            try:
                with u.step() as s:
                    now = db_now(s)
                    s.add(
                        TrialConfigRow(
                            study_name=spec.name,
                            config_key=asked.config.key,
                            trial_number=asked.number,
                            state="pending",
                        )
                    )
                    s.flush()
                    if self._launched(s, spec.name) > spec.budget.max_trials:
                        raise _BudgetUsed  # a concurrent ask took the last place
                    lease = self._new_lease(s, spec, "trial", worker_id, now, config=asked.config, number=asked.number)
                    if lease is None:
                        raise _WorkerBusy
                    log.info("lease %s: study %s trial %d %s -> %s", lease.id, spec.name, asked.number,
                             asked.config.key, worker_id)  # fmt: skip
                    return self._lease_out(lease)
            except IntegrityError:
                self._answer_duplicate(study, spec, asked)
            except _WorkerBusy:
                opt.tell_failed(study, asked.number, {"reason": "worker got another lease concurrently"})
                return None
            except _BudgetUsed:
                opt.tell_failed(study, asked.number, {"reason": "budget used by a concurrent ask"})
                return None
            except BaseException:
                # Never leave a RUNNING trial behind that no lease will ever finish.
                opt.tell_failed(study, asked.number, {"reason": "lease could not be recorded"})
                raise
        # Every proposal was a duplicate or known to fail: the space may be used up.
        with u.step() as s:
            study_svc.maybe_finish(s, spec, db_now(s), storage)
        return None

    def _answer_duplicate(self, study: optuna.Study, spec: StudySpec, asked: opt.AskedTrial) -> None:
        """The sampler proposed a configuration already launched: answer it without a restart."""
        with self.ctx.sessions() as s:
            prior = s.scalars(
                select(TrialConfigRow).where(
                    TrialConfigRow.study_name == spec.name, TrialConfigRow.config_key == asked.config.key
                )
            ).one()
        attrs = {"duplicate_of": prior.trial_number}
        previous = opt.get_trial(study, prior.trial_number)
        if prior.state == "done" and previous.value is not None:
            violation = previous.constraints.get(CONSTRAINT_KEY, 0.0)
            opt.tell_value(study, asked.number, previous.value, violation, {**previous.user_attrs, **attrs})
        elif prior.state == "infeasible":
            opt.tell_infeasible(study, asked.number, attrs)
        elif prior.state == "pruned":
            opt.tell_pruned(study, asked.number, attrs)
        else:
            opt.tell_failed(study, asked.number, {**attrs, "reason": "duplicate of a configuration in flight"})

    # ------------------------------------------------------------------ expiry

    def reclaim_expired(self) -> int:
        """Expire leases past their deadline (database clock); re-queue or fail their trials."""
        to_fail: list[tuple[StudySpec, int, str]] = []
        with self.ctx.unit() as u:
            with u.step() as s:
                now = db_now(s)
                expired = s.scalars(
                    select(LeaseRow)
                    .where(LeaseRow.state == "active", LeaseRow.deadline < now)
                    .with_for_update(skip_locked=True)
                ).all()
                for lease in expired:
                    lease.state = "expired"
                    lease.finished_at = now
                    self._event(s, "lease_expired", lease, f"no heartbeat since deadline {lease.deadline}")
                    if lease.worker_id is not None:
                        self._host_failure(s, lease.worker_id, "lease expired without a report")
                    if lease.kind == "trial" and lease.trial_number is not None:
                        spec = study_svc.spec_of(s, lease.study_name)
                        failed = self._retry_or_fail(s, spec, lease, now, "lease expired")
                        if failed is not None:
                            to_fail.append(failed)
                    elif lease.kind == "confirm":
                        spec = study_svc.spec_of(s, lease.study_name)
                        self._retry_confirm(s, lease, now, "lease expired")
                        study_svc.maybe_finish(s, spec, now, self.ctx.storage)
            for spec, number, reason in to_fail:
                self._tell_failed(spec, number, reason)
        self._fail_orphans()
        return len(expired)

    def _fail_orphans(self) -> None:
        """Fail trials Optuna handed out whose lease was never recorded.

        `_ask_new` asks Optuna (committed at once) and then records the lease; an API process or
        a database that dies in between leaves a RUNNING trial no lease will ever finish, which
        constant-liar TPE would count as a pessimistic guess forever and which would keep its
        study from finishing.  A RUNNING trial without a queued or active lease that is older
        than `orphan_grace_s` (asks take milliseconds) is told FAIL, then the study may finish.
        """
        with self.ctx.sessions() as s:
            now = db_now(s)
            names = list(s.scalars(select(StudyRow.name).where(StudyRow.state == "running")))
        grace = timedelta(seconds=self.settings.orphan_grace_s)
        storage = self.ctx.storage
        for name in names:
            try:
                study_id = storage.get_study_id_from_name(name)
            except KeyError:
                continue
            running = storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
            old = [t for t in running if t.datetime_start is None or now - t.datetime_start >= grace]
            if not old:
                continue
            with self.ctx.sessions() as s:
                held = set(
                    s.scalars(
                        select(LeaseRow.trial_number).where(
                            LeaseRow.study_name == name,
                            LeaseRow.kind == "trial",
                            LeaseRow.state.in_(("queued", "active")),
                        )
                    )
                )
                spec = study_svc.spec_of(s, name)
            orphans = [t.number for t in old if t.number not in held]
            for number in orphans:
                log.warning("study %s: trial %d was asked but never leased; telling it FAIL", name, number)
                self._tell_failed(spec, number, "asked from Optuna but never leased (the API or database failed)")
            if orphans:
                with self.ctx.unit() as u, u.step() as s:
                    study_svc.maybe_finish(s, spec, db_now(s), storage)

    def _retry_or_fail(
        self, s: Session, spec: StudySpec, lease: LeaseRow, now: datetime, reason: str
    ) -> tuple[StudySpec, int, str] | None:
        assert lease.trial_number is not None
        if lease.attempt < self.settings.max_attempts:
            config = SpecConfig.model_validate(lease.payload["config"])
            self._new_lease(
                s, spec, "trial", None, now, config=config, number=lease.trial_number, attempt=lease.attempt + 1
            )
            self._event(s, "trial_requeued", lease, f"{reason}; attempt {lease.attempt + 1} queued")
            return None
        self._set_config_state(s, spec.name, lease.config_key, "failed")
        return spec, lease.trial_number, f"{reason}; gave up after {lease.attempt} attempts"

    def _retry_confirm(self, s: Session, lease: LeaseRow, now: datetime, reason: str) -> None:
        """Queue a confirmation again (its baseline pairing is redone), up to max_attempts."""
        if lease.attempt >= self.settings.max_attempts:
            self._event(s, "confirm_given_up", lease, f"{reason}; gave up after {lease.attempt} attempts")
            return
        info = {k: v for k, v in (lease.payload.get("confirm") or {}).items() if k != "baseline_id"}
        s.add(
            LeaseRow(
                id=str(uuid.uuid4()),
                study_name=lease.study_name,
                kind="confirm",
                state="queued",
                worker_id=None,
                trial_number=lease.trial_number,
                attempt=lease.attempt + 1,
                config_key=lease.config_key,
                payload={**lease.payload, "confirm": info},
                created_at=now,
            )
        )
        self._event(s, "confirm_requeued", lease, f"{reason}; attempt {lease.attempt + 1} queued")

    def _tell_failed(self, spec: StudySpec, number: int, reason: str) -> None:
        study = opt.load_study(self.ctx.storage, spec)
        try:
            opt.tell_failed(study, number, {"failure_reason": reason})
        except TrialStateError:
            log.info("trial %d of %s already finished; nothing to fail", number, spec.name)

    # ------------------------------------------------------------------ heartbeat / progress

    def _owned(self, s: Session, principal: Principal, lease_id: str, *, for_update: bool = True) -> LeaseRow:
        q = select(LeaseRow).where(LeaseRow.id == lease_id)
        if for_update:
            q = q.with_for_update()
        lease = s.scalars(q).first()
        if lease is None:
            raise NotFoundError(f"no lease {lease_id}")
        require_worker(principal, lease.worker_id or "")
        if principal.worker_id is not None and lease.worker_id != principal.worker_id:
            raise ForbiddenError("this lease belongs to another worker")
        return lease

    def _require_live(self, s: Session, lease: LeaseRow, now: datetime) -> None:
        if lease.state == "expired" or (
            lease.state == "active" and lease.deadline is not None and lease.deadline < now
        ):
            raise LeaseGoneError(f"lease {lease.id} expired and was reclaimed; stop this work")
        if lease.state != "active":
            raise ConflictError(f"lease {lease.id} is {lease.state}; stop this work")

    def heartbeat(self, principal: Principal, lease_id: str) -> HeartbeatOut:
        with self.ctx.unit() as u, u.step() as s:
            now = db_now(s)
            lease = self._owned(s, principal, lease_id)
            self._require_live(s, lease, now)
            lease.deadline = now + timedelta(seconds=self.settings.lease_ttl_s)
            self._touch_seen(s, lease.worker_id, now)
            return HeartbeatOut(deadline=lease.deadline.replace(tzinfo=UTC))

    def progress(self, principal: Principal, lease_id: str, body: ProgressIn) -> ProgressOut:
        with self.ctx.unit() as u:
            with u.step() as s:
                now = db_now(s)
                lease = self._owned(s, principal, lease_id)
                self._require_live(s, lease, now)
                lease.deadline = now + timedelta(seconds=self.settings.lease_ttl_s)
                if lease.kind != "trial" or lease.trial_number is None or lease.worker_id is None:
                    return ProgressOut(action="continue")
                spec = study_svc.spec_of(s, lease.study_name)
                base_row = self._baseline(s, lease.worker_id, study_svc.baseline_key_of(spec))
                base = None if base_row is None else _tok_s(base_row)
                number = lease.trial_number
            if base is None or body.concurrency not in base or base[body.concurrency] <= 0:
                return ProgressOut(action="continue")
            return self._progress_trial(spec, number, body, body.output_tok_s / base[body.concurrency])

    def _progress_trial(self, spec: StudySpec, number: int, body: ProgressIn, speedup: float) -> ProgressOut:
        """Record the level's speedup; prune when the trial can no longer win (optimizer.pruning)."""
        study = opt.load_study(self.ctx.storage, spec)
        try:
            trial = opt.get_trial(study, number)
            if trial.state.is_finished():
                raise TrialStateError(f"trial {number} is {trial.state.name}")
            partial = {int(k): float(v) for k, v in (trial.user_attrs.get("progress_speedup_by_level") or {}).items()}
            partial[body.concurrency] = speedup
            attrs: dict[str, Any] = {"progress_speedup_by_level": {str(k): v for k, v in partial.items()}}
            decision = None
            if not set(spec.workload.concurrency) <= set(partial):  # else nothing is left to save
                decision = pruning.decide(spec, study.get_trials(deepcopy=False), partial)
                if decision.prune:
                    attrs["pruned"] = {"after_concurrency": body.concurrency, "reason": decision.reason}
            opt.record_progress(study, number, body.step, speedup, attrs)
            if decision is None or not decision.prune:
                return ProgressOut(action="continue")
        except TrialStateError:
            raise ConflictError(f"trial {number} is already finished; stop this work") from None
        log.info("study %s trial %d pruned after concurrency %d: %s", spec.name, number, body.concurrency,
                 decision.reason)  # fmt: skip
        return ProgressOut(action="prune")

    # ------------------------------------------------------------------ complete

    def complete(self, principal: Principal, lease_id: str, body: CompleteIn) -> CompleteOut:
        if body.outcome == "ok" and body.metrics is None:
            raise_invalid("metrics", "an ok outcome needs metrics")
        if body.outcome == "failed" and body.failure is None:
            raise_invalid("failure", "a failed outcome needs a failure with kind and message")
        with self.ctx.unit(lock=f"lease:{lease_id}") as u:
            with u.step() as s:
                lease = self._owned(s, principal, lease_id)
                if lease.state in ("completed", "failed"):
                    return CompleteOut(lease_id=lease.id, state=lease.state, speedup=lease.speedup, duplicate=True)
                if lease.state in ("queued", "superseded"):
                    raise ConflictError(f"lease {lease.id} is {lease.state}; this report is not expected")
                late = lease.state == "expired"
                spec = study_svc.spec_of(s, lease.study_name)
                kind = lease.kind
            if kind == "baseline":
                return self._complete_baseline(u, spec, lease_id, body, late)
            if kind == "confirm":
                return self._complete_confirm(u, spec, lease_id, body, late)
            return self._complete_trial(u, spec, lease_id, body, late)

    def _complete_confirm(self, u: Any, spec: StudySpec, lease_id: str, body: CompleteIn, late: bool) -> CompleteOut:
        """A candidate re-measured: its speedup and interval against the baseline paired with it."""
        with u.step() as s:
            now = db_now(s)
            lease = s.get(LeaseRow, lease_id)
            assert lease is not None and lease.worker_id is not None
            info = dict(lease.payload.get("confirm") or {})
            key = study_svc.baseline_key_of(spec)
            base_row = s.get(BaselineRow, info["baseline_id"]) if "baseline_id" in info else None
            if base_row is None:
                base_row = self._baseline(s, lease.worker_id, key)
            lease.finished_at = now
            if late:
                for other in s.scalars(
                    select(LeaseRow).where(
                        LeaseRow.study_name == spec.name,
                        LeaseRow.kind == "confirm",
                        LeaseRow.trial_number == lease.trial_number,
                        LeaseRow.state.in_(("queued", "active")),
                        LeaseRow.id != lease.id,
                    )
                ):
                    other.state = "superseded"
                    other.finished_at = now
                self._event(s, "late_report_kept", lease, f"confirmation of trial {lease.trial_number} reported late")
            if body.outcome == "ok" and body.metrics is not None and base_row is not None:
                levels = [lv.model_dump(mode="json") for lv in body.metrics.levels]
                base_levels = base_row.metrics.get("levels", [])
                result = confirm.confirm_result(spec, levels, base_levels)
                lease.state = "completed"
                lease.speedup = result.value
                lease.result = {
                    **body.model_dump(mode="json"),
                    "confirmation": {
                        **result.as_json(),
                        "baseline_id": base_row.id,
                        "baseline_lease_id": base_row.lease_id,
                        "baseline_measured_at": base_row.measured_at.isoformat(),
                        "baseline_levels": base_levels,
                    },
                }
                self._host_success(s, lease.worker_id)
            else:
                lease.state = "failed"
                lease.result = body.model_dump(mode="json")
                failure = body.failure
                reason = "no baseline to pair with" if failure is None else f"{failure.kind}: {failure.message}"
                if failure is not None and (failure.host_fault or failure.kind not in CONFIG_FAILURES):
                    if failure.kind != "lost":
                        self._host_failure(s, lease.worker_id, reason)
                    self._retry_confirm(s, lease, now, reason)
                else:
                    self._event(s, "confirm_failed", lease, reason)
            study_svc.maybe_finish(s, spec, now, self.ctx.storage)
            return CompleteOut(lease_id=lease.id, state=lease.state, speedup=lease.speedup)

    def _complete_baseline(self, u: Any, spec: StudySpec, lease_id: str, body: CompleteIn, late: bool) -> CompleteOut:
        with u.step() as s:
            now = db_now(s)
            lease = s.get(LeaseRow, lease_id)
            assert lease is not None and lease.worker_id is not None
            lease.finished_at = now
            lease.result = body.model_dump(mode="json")
            if body.outcome == "ok" and body.metrics is not None:
                lease.state = "completed"
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
                self._host_success(s, lease.worker_id)
            else:
                lease.state = "failed"
                assert body.failure is not None
                self._host_failure(s, lease.worker_id, f"baseline failed: {body.failure.kind}: {body.failure.message}")
            if late:
                self._event(s, "late_report_kept", lease, "baseline reported after its lease expired")
            return CompleteOut(lease_id=lease.id, state=lease.state)

    def _complete_trial(self, u: Any, spec: StudySpec, lease_id: str, body: CompleteIn, late: bool) -> CompleteOut:
        study = opt.load_study(self.ctx.storage, spec)
        with u.step() as s:
            now = db_now(s)
            lease = s.get(LeaseRow, lease_id)
            assert lease is not None and lease.worker_id is not None and lease.trial_number is not None
            number = lease.trial_number
            worker_id = lease.worker_id
            base_row = self._baseline(s, worker_id, study_svc.baseline_key_of(spec))
            base = None if base_row is None else _tok_s(base_row)
            attrs: dict[str, Any] = {
                "worker_id": worker_id,
                "lease_id": lease.id,
                "attempt": lease.attempt,
                "config": lease.payload["config"],
                "config_key": lease.config_key,
                "baseline_levels": [] if base_row is None else base_row.metrics.get("levels", []),
            }
            if late:
                # The measurement is real: keep it, and retire the retry that replaced this lease.
                for other in s.scalars(
                    select(LeaseRow).where(
                        LeaseRow.study_name == spec.name,
                        LeaseRow.trial_number == number,
                        LeaseRow.state.in_(("queued", "active")),
                        LeaseRow.id != lease.id,
                    )
                ):
                    other.state = "superseded"
                    other.finished_at = now
                self._event(s, "late_report_kept", lease, f"trial {number} reported after its lease expired")
        # Artifacts (the report as JSON, the server-log tail) must be attached before the tell:
        # a finished trial takes no more (reference/optuna.md §8).  Best effort, never fatal.
        log_tail = body.failure.log_tail if body.failure else body.metrics.log_tail if body.metrics else ""
        report = body.model_dump(mode="json", exclude={"metrics": {"log_tail"}, "failure": {"log_tail"}})
        store_trial_artifacts(self.ctx, spec.name, number, report, log_tail or None)
        outcome_state, speedup = self._tell_trial(study, spec, number, body, base, attrs)
        requeue = outcome_state == "retry"
        to_fail = None
        with u.step() as s:
            now = db_now(s)
            lease = s.get(LeaseRow, lease_id)
            assert lease is not None
            if lease.state in ("completed", "failed"):
                # A concurrent repeat of this report got here first (SQLite has no lease lock).
                return CompleteOut(lease_id=lease.id, state=lease.state, speedup=lease.speedup, duplicate=True)
            lease.finished_at = now
            lease.result = body.model_dump(mode="json")
            lease.speedup = speedup
            lease.state = "completed" if body.outcome == "ok" else "failed"
            failure = body.failure
            if outcome_state == "done":
                self._set_config_state(s, spec.name, lease.config_key, "done")
                self._host_success(s, worker_id)
            elif outcome_state == "infeasible":
                self._set_config_state(s, spec.name, lease.config_key, "infeasible")
                self._host_success(s, worker_id)
            elif outcome_state == "pruned":
                self._set_config_state(s, spec.name, lease.config_key, "pruned")
                self._host_success(s, worker_id)
            elif requeue and failure is not None:
                if failure.kind != "lost":  # a worker shutting down is not a sick host
                    self._host_failure(s, worker_id, f"{failure.kind}: {failure.message}")
                to_fail = self._retry_or_fail(s, spec, lease, now, f"{failure.kind}: {failure.message}")
            study_svc.maybe_finish(s, spec, now, self.ctx.storage)
            out = CompleteOut(lease_id=lease.id, state=lease.state, speedup=speedup)
        if to_fail is not None:
            # Outside the step: on SQLite Optuna's write must not wait for our write lock.
            self._tell_failed(*to_fail)
        return out

    def _tell_trial(
        self,
        study: optuna.Study,
        spec: StudySpec,
        number: int,
        body: CompleteIn,
        base: dict[int, float] | None,
        attrs: dict[str, Any],
    ) -> tuple[str, float | None]:
        """Tell Optuna; returns (done | infeasible | pruned | retry, speedup)."""
        try:
            if body.outcome == "ok":
                assert body.metrics is not None
                if base is None:
                    raise ConflictError("no baseline of this worker for this study; it must measure one first")
                levels = [
                    LevelResult(lv.concurrency, lv.output_tok_s, lv.itl_ms_p99, lv.ttft_ms_p99)
                    for lv in body.metrics.levels
                ]
                measured = {lv.concurrency: base[lv.concurrency] for lv in levels if lv.concurrency in base}
                m = body.metrics
                if {lv.concurrency for lv in levels} < set(spec.workload.concurrency):
                    # Stopped early (pruned): a partial workload must not pose as a measured value.
                    partial = {str(lv.concurrency): lv.output_tok_s / measured[lv.concurrency] for lv in levels
                               if lv.concurrency in measured}  # fmt: skip
                    attrs |= {
                        "partial_speedup_by_level": partial,
                        "baseline_tok_s": {str(k): v for k, v in measured.items()},
                        "levels": [lv.model_dump(mode="json") for lv in m.levels],
                        "startup_s": m.startup_s,
                        "effective": m.effective,
                        "sglang_version": m.sglang_version,
                    }
                    opt.tell_pruned(study, number, attrs)
                    return "pruned", None
                sc = score(spec.objective, levels, measured)
                attrs |= {
                    "speedup_by_level": {str(k): v for k, v in sc.speedups.items()},
                    "baseline_tok_s": {str(k): v for k, v in measured.items()},
                    "levels": [lv.model_dump(mode="json") for lv in m.levels],
                    "startup_s": m.startup_s,
                    "effective": m.effective,
                    "sglang_version": m.sglang_version,
                }
                opt.tell_value(study, number, sc.value, sc.violation, attrs)
                return "done", sc.value
            failure = body.failure
            assert failure is not None
            attrs |= {"failure_kind": failure.kind, "failure_message": failure.message[:2000]}
            if failure.kind in CONFIG_FAILURES and not failure.host_fault:
                opt.tell_infeasible(study, number, attrs | {"log_tail": failure.log_tail[-4000:]})
                return "infeasible", None
            return "retry", None
        except TrialStateError:
            # Already told (e.g. a retry finished first): keep the report in our own record only.
            return "done", None

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _baseline(s: Session, worker_id: str, key: str) -> BaselineRow | None:
        return s.scalars(
            select(BaselineRow)
            .where(BaselineRow.worker_id == worker_id, BaselineRow.baseline_key == key)
            .order_by(BaselineRow.measured_at.desc())
            .limit(1)
        ).first()

    @staticmethod
    def _set_config_state(s: Session, study: str, key: str | None, state: str) -> None:
        if key is None:
            return
        row = s.scalars(
            select(TrialConfigRow).where(TrialConfigRow.study_name == study, TrialConfigRow.config_key == key)
        ).first()
        if row is not None:
            row.state = state

    @staticmethod
    def _touch_seen(s: Session, worker_id: str | None, now: datetime) -> None:
        if worker_id is not None and (w := s.get(WorkerRow, worker_id)) is not None:
            w.last_seen = now

    def _host_failure(self, s: Session, worker_id: str, reason: str) -> None:
        w = s.get(WorkerRow, worker_id)
        if w is None:
            return
        w.consecutive_host_failures += 1
        if w.consecutive_host_failures >= self.settings.quarantine_after and not w.quarantined:
            w.quarantined = True
            w.quarantine_reason = f"{w.consecutive_host_failures} host failures in a row; last: {reason}"[:512]
            s.add(EventRow(at=db_now(s), kind="worker_quarantined", worker_id=worker_id, detail=w.quarantine_reason))
            log.warning("worker %s quarantined: %s", worker_id, w.quarantine_reason)

    @staticmethod
    def _host_success(s: Session, worker_id: str) -> None:
        w = s.get(WorkerRow, worker_id)
        if w is not None:
            w.consecutive_host_failures = 0

    @staticmethod
    def _event(s: Session, kind: str, lease: LeaseRow, detail: str) -> None:
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

    def _lease_out(self, lease: LeaseRow) -> LeaseOut:
        assert lease.deadline is not None
        p = lease.payload
        return LeaseOut.model_validate(
            {
                "lease_id": lease.id,
                "kind": lease.kind,
                "study": lease.study_name,
                "trial_number": lease.trial_number,
                "attempt": lease.attempt,
                "deadline": lease.deadline.replace(tzinfo=UTC),
                "heartbeat_interval_s": self.settings.heartbeat_interval_s,
                "server": p["server"],
                "workload": p["workload"],
                "config": p.get("config"),
            }
        )


def _tok_s(row: BaselineRow) -> dict[int, float]:
    return {int(k): float(v) for k, v in row.tok_s.items()}


class _WorkerBusy(Exception):
    pass


class _BudgetUsed(Exception):
    pass


def raise_invalid(field: str, message: str) -> None:
    from api.errors import InvalidInputError

    raise InvalidInputError(f"{field}: {message}", field=field)
