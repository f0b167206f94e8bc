"""Trial leases: ask Optuna for a configuration, launch it once, take its result.

A trial lease carries one Optuna trial.  Its life: asked (`ask_new`) or re-queued after a host
fault (`retry_or_fail`), claimed by a worker (`claim_retry`), reported (`complete`), or given up
after `max_attempts` with the failure and whatever levels were measured kept with the trial.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import optuna
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.artifacts import store_trial_artifacts
from api.context import ServiceContext, Unit
from api.db import db_now
from api.errors import ConflictError
from api.models import LeaseRow
from api.services import study_life
from api.services.lease_rows import LeasePayload
from api.services.leasing import records
from api.services.leasing.records import HostHealth, event, lease_out
from api.services.leasing.sql_store import SqlStudyStore, lease_record
from api.services.leasing.states import (
    ConfigState,
    LeaseKind,
    LeaseState,
    WorkerHoldsLeaseError,
    claim,
    end,
)
from api.services.study_specs import baseline_key_of, load_study, study_trials
from optimizer import actions, pruning
from optimizer import attrs as A
from optimizer import study as opt
from optimizer.errors import TrialStateError
from optimizer.spec import StudySpec
from optimizer.store import GiveUp as GiveUp  # expiry and ending take it from here
from optimizer.store import NotRecorded
from spectune_protocol import CompleteIn, CompleteOut, LeaseOut, ProgressIn, ProgressOut

log = logging.getLogger("spectune.api.leasing")


class TrialLeases:
    def __init__(self, ctx: ServiceContext, health: HostHealth) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.health = health

    # ------------------------------------------------------------------ handing out

    def claim_retry(self, s: Session, lease_id: str, worker_id: str, now: datetime) -> LeaseRow | None:
        """The conductor's `RetryLease`: a queued retry, now active for `worker_id` (None when
        another request took it meanwhile)."""
        lease = s.get(LeaseRow, lease_id, with_for_update=True)
        if lease is None or lease.state != LeaseState.QUEUED:
            return None
        claim(s, lease, worker_id, now, self.settings.lease_ttl_s)
        return lease

    def ask_new(self, u: Unit, spec: StudySpec, worker_id: str) -> LeaseOut | None:
        """Ask Optuna for a configuration not launched yet and lease it to `worker_id`
        (optimizer.actions.ask on the service's store).

        Runs under the study's lock (LeaseService.lease), so asks of one study never interleave.
        """
        store = SqlStudyStore(self.ctx, spec, unit=u)
        with u.step() as s:
            now = db_now(s)
        try:
            asked = actions.ask(store, worker_id, now)
        except NotRecorded as e:
            raise WorkerHoldsLeaseError(e.reason) from e
        if asked is None:
            return None
        with u.step() as s:
            lease = s.get(LeaseRow, asked[0].id)
            assert lease is not None
            return lease_out(lease, self.settings)

    # ------------------------------------------------------------------ progress

    def progress(self, spec: StudySpec, lease_id: str, number: int, body: ProgressIn, speedup: float) -> ProgressOut:
        """Record the level's speedup; prune when the trial can no longer win (optimizer.pruning).

        A trial that is already finished ends this lease for good (superseded) before the 409,
        so the worker is never handed it again.
        """
        study = opt.load_study(self.ctx.storage, spec)
        try:
            trial = opt.get_trial(study, number)
            if trial.state.is_finished():
                raise TrialStateError(f"trial {number} is {trial.state.name}")
            partial = A.TrialRecord(trial).progress_speedup_by_level
            partial[body.concurrency] = speedup
            attrs: dict[str, Any] = {A.PROGRESS_SPEEDUP_BY_LEVEL: {str(k): v for k, v in partial.items()}}
            decision = None
            if not set(spec.workload.concurrency) <= set(partial):  # else nothing is left to save
                # Screened: a quarantined trial is no best to prune against.
                trials = study_trials(self.ctx.storage, self.ctx.sessions, spec.name)
                decision = pruning.decide(spec, trials, partial)
                if decision.prune:
                    attrs[A.PRUNED] = {"after_concurrency": body.concurrency, "reason": decision.reason}
            opt.record_progress(study, number, body.step, speedup, attrs)
            if decision is None or not decision.prune:
                return ProgressOut(action="continue")
        except TrialStateError:
            self.supersede(lease_id, f"trial {number} finished while this lease ran")
            raise ConflictError(f"trial {number} is already finished; stop this work") from None
        log.info("study %s trial %d pruned after concurrency %d: %s", spec.name, number, body.concurrency,
                 decision.reason)  # fmt: skip
        return ProgressOut(action="prune")

    def supersede(self, lease_id: str, why: str) -> None:
        """End a live lease whose trial has its answer elsewhere (a no-op if it ended meanwhile)."""
        with self.ctx.unit(lock=f"lease:{lease_id}") as u, u.step() as s:
            lease = s.get(LeaseRow, lease_id, with_for_update=True)
            if lease is None or lease.state not in (LeaseState.ACTIVE, LeaseState.QUEUED):
                return
            end(s, lease, LeaseState.SUPERSEDED, db_now(s))
            event(s, "lease_superseded", lease, why)
            log.warning("lease %s superseded: %s", lease_id, why)

    # ------------------------------------------------------------------ results

    def complete(self, u: Unit, spec: StudySpec, lease_id: str, body: CompleteIn, late: bool) -> CompleteOut:
        # Screened: an infeasible configuration's pessimistic value ignores quarantined trials.
        study = load_study(self.ctx.storage, self.ctx.sessions, spec)
        with u.step() as s:
            lease = s.get(LeaseRow, lease_id)
            assert lease is not None and lease.worker_id is not None and lease.trial_number is not None
            config = LeasePayload.of(lease).config
            number = lease.trial_number
            worker_id = lease.worker_id
            base_row = records.latest_baseline(s, worker_id, baseline_key_of(spec))
            base = None if base_row is None else records.baseline_tok_s(base_row)
            attrs: dict[str, Any] = {
                A.WORKER_ID: worker_id,
                A.LEASE_ID: lease.id,
                A.ATTEMPT: lease.attempt,
                A.CONFIG: None if config is None else config.model_dump(mode="json"),
                A.CONFIG_KEY: lease.config_key,
                A.BASELINE_LEVELS: [] if base_row is None else base_row.metrics.get("levels", []),
            }
        # Artifacts (the report as JSON, the server-log tail) must be attached before the tell:
        # a finished trial takes no more (docs/optuna.md).  Best effort, never fatal.
        log_tail = body.failure.log_tail if body.failure else body.metrics.log_tail if body.metrics else ""
        report = body.model_dump(mode="json", exclude={"metrics": {"log_tail"}, "failure": {"log_tail"}})
        store_trial_artifacts(self.ctx, spec.name, number, report, log_tail or None)
        outcome_state, speedup = self._tell(study, spec, number, body, base, attrs)
        give_up = None
        trials = study_trials(self.ctx.storage, self.ctx.sessions, spec.name)
        with u.step() as s:
            now = db_now(s)
            lease = s.get(LeaseRow, lease_id)
            assert lease is not None
            if lease.state not in (LeaseState.ACTIVE, LeaseState.EXPIRED):
                # A concurrent repeat of this report got here first.
                return CompleteOut(lease_id=lease.id, state=lease.state, speedup=lease.speedup, duplicate=True)
            if late:
                # The measurement is real: keep it, and retire the retry that replaced this lease.
                self._supersede_others(s, spec.name, number, lease.id, now)
                event(s, "late_report_kept", lease, f"trial {number} reported after its lease expired")
            to = LeaseState.COMPLETED if body.outcome == "ok" else LeaseState.FAILED
            end(s, lease, to, now, result=body.model_dump(mode="json"), speedup=speedup)
            failure = body.failure
            if outcome_state in (ConfigState.DONE, ConfigState.INFEASIBLE, ConfigState.PRUNED):
                records.set_config_state(s, spec.name, lease.config_key, outcome_state)
                self.health.success(s, worker_id)
            elif failure is not None:
                if records.counts_against_host(failure.kind):
                    self.health.failure(s, worker_id, f"{failure.kind}: {failure.message}")
                give_up = self.retry_or_fail(s, spec, lease, now, failure.kind, failure.message)
            if give_up is None:
                study_life.settle(s, spec, now, trials, self.settings)
            out = CompleteOut(lease_id=lease.id, state=lease.state, speedup=speedup)
        if give_up is not None:
            # Outside the step: on SQLite Optuna's write must not wait for our write lock.
            self.tell_given_up(give_up)
        return out

    @staticmethod
    def _supersede_others(s: Session, study: str, number: int, keep: str, now: datetime) -> None:
        for other in s.scalars(
            select(LeaseRow).where(
                LeaseRow.study_name == study,
                LeaseRow.kind == LeaseKind.TRIAL,
                LeaseRow.trial_number == number,
                LeaseRow.state.in_((LeaseState.QUEUED, LeaseState.ACTIVE)),
                LeaseRow.id != keep,
            )
        ):
            end(s, other, LeaseState.SUPERSEDED, now)

    @staticmethod
    def _tell(
        study: optuna.Study,
        spec: StudySpec,
        number: int,
        body: CompleteIn,
        base: dict[int, float] | None,
        attrs: dict[str, Any],
    ) -> tuple[ConfigState | None, float | None]:
        """Tell Optuna (optimizer.actions); returns (the configuration's state, or None to retry; speedup)."""
        if body.outcome == "ok":
            assert body.metrics is not None
            if base is None:
                raise ConflictError("no baseline of this worker for this study; it must measure one first")
            m = body.metrics
            extra = {A.STARTUP_S: m.startup_s, A.EFFECTIVE: m.effective, A.SGLANG_VERSION: m.sglang_version}
            levels = [lv.model_dump(mode="json") for lv in m.levels]
            return actions.tell_measured(study, spec, number, levels, base, attrs, extra)
        failure = body.failure
        assert failure is not None
        state = actions.tell_failure(
            study,
            number,
            failure.kind,
            failure.message,
            attrs,
            host_fault=failure.host_fault,
            log_tail=failure.log_tail,
        )
        return state, None

    # ------------------------------------------------------------------ retries

    def retry_or_fail(
        self, s: Session, spec: StudySpec, lease: LeaseRow, now: datetime, kind: str, message: str
    ) -> GiveUp | None:
        """Queue the trial again (a new lease, attempt + 1), or give it up after max_attempts
        (optimizer.actions.retry_or_give_up: what the attempts learnt is kept)."""
        store = SqlStudyStore(self.ctx, spec, session=s)
        return actions.retry_or_give_up(store, lease_record(lease), now, kind, message, self.settings.max_attempts)

    def tell_given_up(self, give_up: GiveUp) -> None:
        actions.tell_given_up(opt.load_study(self.ctx.storage, give_up.spec), give_up)
