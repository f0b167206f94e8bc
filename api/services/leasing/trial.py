"""Trial leases: ask Optuna for a configuration, launch it once, take its result.

A trial lease carries one Optuna trial.  Its life: asked (`ask_new`) or re-queued after a host
fault (`retry_or_fail`), claimed by a worker (`claim_retry`), reported (`complete`), or given up
after `max_attempts` with the failure and whatever levels were measured kept with the trial.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import optuna
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.artifacts import store_trial_artifacts
from api.context import ServiceContext, Unit
from api.db import db_now
from api.errors import ConflictError
from api.models import LeaseRow, StudyRow, TrialConfigRow
from api.services import lease_rows, study_life, trial_records
from api.services.leasing import records
from api.services.leasing.records import CONFIG_FAILURES, HostHealth, event, lease_out
from api.services.leasing.states import (
    ConfigState,
    LeaseKind,
    LeaseState,
    StudyState,
    WorkerHoldsLeaseError,
    claim,
    end,
)
from api.services.study_specs import baseline_key_of, launched_count, load_study, study_trials
from optimizer import attrs as A
from optimizer import pruning
from optimizer import study as opt
from optimizer.errors import TrialStateError
from optimizer.infeasible import known_to_fail, oom_points
from optimizer.objective import CONSTRAINT_KEY, score_levels
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from spectune_protocol import CompleteIn, CompleteOut, LeaseOut, ProgressIn, ProgressOut

log = logging.getLogger("spectune.api.leasing")

# Proposals that turn out to be a configuration already launched are answered without a launch;
# bound the loop so a nearly exhausted space cannot spin.
MAX_DUPLICATE_PROPOSALS = 12


@dataclass(frozen=True)
class GiveUp:
    """A trial out of attempts, to be told FAIL once our transaction is closed."""

    spec: StudySpec
    number: int
    attrs: dict[str, Any]


class _NotRecorded(Exception):
    """The asked trial could not get a lease; `reason` says why (it is told FAIL)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


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
        """Ask Optuna for a configuration not launched yet and lease it to `worker_id`.

        Runs under the study's lock (LeaseService.lease), so asks of one study never interleave.
        """
        storage = self.ctx.storage
        for _ in range(MAX_DUPLICATE_PROPOSALS):
            # Screened: a quarantined trial steers no proposal (trial_records.sampler_screen).
            study = load_study(storage, self.ctx.sessions, spec)
            asked = opt.ask(study, spec)
            # Screened: a quarantined OOM proves nothing about the region around it.
            proof = known_to_fail(asked.config, oom_points(study_trials(storage, self.ctx.sessions, spec.name)))
            if proof is not None:
                # Needs at least the memory of a configuration that ran out of it: no launch.
                opt.tell_infeasible(
                    study,
                    asked.number,
                    {
                        A.INFERRED_FROM: proof.trial_number,
                        A.FAILURE_KIND: "oom",
                        A.FAILURE_MESSAGE: f"not launched: needs at least the GPU memory of trial "
                        f"{proof.trial_number} ({proof.config.key}), which ran out of memory",
                    },
                )
                log.info("study %s trial %d %s: skipped, known to run out of memory (trial %d)",
                         spec.name, asked.number, asked.config.key, proof.trial_number)  # fmt: skip
                continue
            try:
                with u.step() as s:
                    lease = self._record(s, spec, worker_id, asked)
                    log.info("lease %s: study %s trial %d %s -> %s", lease.id, spec.name, asked.number,
                             asked.config.key, worker_id)  # fmt: skip
                    return lease_out(lease, self.settings)
            except IntegrityError:
                self._answer_duplicate(study, spec, asked)
            except _NotRecorded as e:
                opt.tell_failed(study, asked.number, {A.FAILURE_KIND: "not_leased", A.FAILURE_MESSAGE: e.reason})
                if isinstance(e.__cause__, IntegrityError):
                    raise WorkerHoldsLeaseError(e.reason) from e
                return None
            except BaseException:
                # Never leave a RUNNING trial behind that no lease will ever finish.
                opt.tell_failed(
                    study,
                    asked.number,
                    {A.FAILURE_KIND: "not_leased", A.FAILURE_MESSAGE: "lease could not be recorded"},
                )
                raise
        # Every proposal was a duplicate or known to fail: the space may be used up.
        trials = study_trials(storage, self.ctx.sessions, spec.name)
        with u.step() as s:
            study_life.settle(s, spec, db_now(s), trials, self.settings)
        return None

    def _record(self, s: Session, spec: StudySpec, worker_id: str, asked: opt.AskedTrial) -> LeaseRow:
        """Record the asked configuration and its lease in one step; raises IntegrityError for a
        configuration launched before, _NotRecorded when the lease cannot be had now."""
        now = db_now(s)
        row = s.get(StudyRow, spec.name)
        if row is None or row.state != StudyState.RUNNING:
            raise _NotRecorded("the study stopped or finished while the trial was asked")
        s.add(
            TrialConfigRow(
                study_name=spec.name,
                config_key=asked.config.key,
                trial_number=asked.number,
                state=ConfigState.PENDING.value,
            )
        )
        s.flush()
        if launched_count(s, spec.name) > spec.budget.max_trials:
            raise _NotRecorded("budget used by a concurrent ask")
        lease = lease_rows.new_lease_row(
            spec, LeaseKind.TRIAL, now, self.settings.lease_ttl_s,
            worker_id=worker_id, config=asked.config, number=asked.number,
        )  # fmt: skip
        try:
            # Added inside the savepoint (see LeaseService._touch_worker).
            with s.begin_nested():
                s.add(lease)
                s.flush()
        except IntegrityError as e:
            # Only the one-active-lease-per-worker index can fire here: a concurrent request of
            # the same worker won; it will be handed that lease when it asks again.
            raise _NotRecorded("the worker got another lease concurrently") from e
        return lease

    def _answer_duplicate(self, study: optuna.Study, spec: StudySpec, asked: opt.AskedTrial) -> None:
        """The sampler proposed a configuration already launched: answer it without a restart."""
        with self.ctx.sessions() as s:
            prior = s.scalars(
                select(TrialConfigRow).where(
                    TrialConfigRow.study_name == spec.name, TrialConfigRow.config_key == asked.config.key
                )
            ).one()
            quarantine = trial_records.quarantined(s, spec.name)
        if prior.trial_number == asked.number:
            # The same trial handed out twice (two asks popped one enqueued trial): the other ask
            # holds it and its lease will report it.  Telling it here would finish a trial whose
            # lease is live, and its worker would be told 409 on every progress call.
            log.error("study %s: trial %d was handed out twice; leaving it to its lease", spec.name, asked.number)
            return
        attrs = {A.DUPLICATE_OF: prior.trial_number}
        previous = opt.get_trial(study, prior.trial_number)
        if prior.trial_number in quarantine:
            # Copying an admin-quarantined measurement would bring it back under a new number.
            message = f"duplicate of trial {prior.trial_number}, which an admin quarantined: its result is not reused"
            opt.tell_failed(study, asked.number, {**attrs, A.FAILURE_KIND: "quarantined", A.FAILURE_MESSAGE: message})
        elif prior.state == ConfigState.DONE and previous.value is not None:
            violation = previous.constraints.get(CONSTRAINT_KEY, 0.0)
            opt.tell_value(study, asked.number, previous.value, violation, {**previous.user_attrs, **attrs})
        elif prior.state == ConfigState.INFEASIBLE:
            opt.tell_infeasible(study, asked.number, attrs)
        elif prior.state == ConfigState.PRUNED:
            opt.tell_pruned(study, asked.number, attrs)
        else:
            opt.tell_failed(
                study,
                asked.number,
                {**attrs, A.FAILURE_KIND: "duplicate", A.FAILURE_MESSAGE: "duplicate of a configuration in flight"},
            )

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
            number = lease.trial_number
            worker_id = lease.worker_id
            base_row = records.latest_baseline(s, worker_id, baseline_key_of(spec))
            base = None if base_row is None else records.baseline_tok_s(base_row)
            attrs: dict[str, Any] = {
                A.WORKER_ID: worker_id,
                A.LEASE_ID: lease.id,
                A.ATTEMPT: lease.attempt,
                A.CONFIG: lease.payload["config"],
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

    def _tell(
        self,
        study: optuna.Study,
        spec: StudySpec,
        number: int,
        body: CompleteIn,
        base: dict[int, float] | None,
        attrs: dict[str, Any],
    ) -> tuple[ConfigState | None, float | None]:
        """Tell Optuna; returns (the configuration's state, or None to retry; speedup)."""
        try:
            if body.outcome == "ok":
                assert body.metrics is not None
                if base is None:
                    raise ConflictError("no baseline of this worker for this study; it must measure one first")
                m = body.metrics
                measured = {lv.concurrency: base[lv.concurrency] for lv in m.levels if lv.concurrency in base}
                level_docs = [lv.model_dump(mode="json") for lv in m.levels]
                common = {
                    A.BASELINE_TOK_S: {str(k): v for k, v in measured.items()},
                    A.LEVELS: level_docs,
                    A.STARTUP_S: m.startup_s,
                    A.EFFECTIVE: m.effective,
                    A.SGLANG_VERSION: m.sglang_version,
                }
                if {lv.concurrency for lv in m.levels} < set(spec.workload.concurrency):
                    # Stopped early (pruned): a partial workload must not pose as a measured value.
                    partial = {str(lv.concurrency): lv.output_tok_s / measured[lv.concurrency] for lv in m.levels
                               if lv.concurrency in measured}  # fmt: skip
                    opt.tell_pruned(study, number, attrs | common | {A.PARTIAL_SPEEDUP_BY_LEVEL: partial})
                    return ConfigState.PRUNED, None
                # By the objective's figure, against the same host's baseline levels (its passes too).
                base_levels = [lv for lv in attrs.get(A.BASELINE_LEVELS) or [] if int(lv["concurrency"]) in measured]
                sc = score_levels(spec.objective, level_docs, base_levels)
                attrs |= common | {A.SPEEDUP_BY_LEVEL: {str(k): v for k, v in sc.speedups.items()}}
                opt.tell_value(study, number, sc.value, sc.violation, attrs)
                return ConfigState.DONE, sc.value
            failure = body.failure
            assert failure is not None
            attrs |= {A.FAILURE_KIND: failure.kind, A.FAILURE_MESSAGE: failure.message[:2000]}
            if failure.kind in CONFIG_FAILURES and not failure.host_fault:
                opt.tell_infeasible(study, number, attrs | {A.LOG_TAIL: failure.log_tail[-4000:]})
                return ConfigState.INFEASIBLE, None
            return None, None
        except TrialStateError:
            # Already told (e.g. a retry finished first): keep the report in our own record only.
            return ConfigState.DONE, None

    # ------------------------------------------------------------------ retries

    def retry_or_fail(
        self, s: Session, spec: StudySpec, lease: LeaseRow, now: datetime, kind: str, message: str
    ) -> GiveUp | None:
        """Queue the trial again (a new lease, attempt + 1), or give it up after max_attempts.

        Giving up keeps what the attempts learnt: the last failure's kind and message, and the
        levels any attempt measured before it was interrupted.
        """
        assert lease.trial_number is not None
        if lease.attempt < self.settings.max_attempts:
            config = SpecConfig.model_validate(lease.payload["config"])
            s.add(
                lease_rows.new_lease_row(
                    spec, LeaseKind.TRIAL, now, self.settings.lease_ttl_s,
                    worker_id=None, config=config, number=lease.trial_number, attempt=lease.attempt + 1,
                )
            )  # fmt: skip
            event(s, "trial_requeued", lease, f"{kind}: {message}; attempt {lease.attempt + 1} queued")
            return None
        records.set_config_state(s, spec.name, lease.config_key, ConfigState.FAILED)
        attrs: dict[str, Any] = {
            A.FAILURE_KIND: kind,
            A.FAILURE_MESSAGE: f"{message[:1800]} (gave up after {lease.attempt} attempts)",
            A.CONFIG: lease.payload.get("config"),
            A.CONFIG_KEY: lease.config_key,
        }
        levels = _levels_measured(s, spec.name, lease.trial_number)
        if levels:
            attrs[A.LEVELS_MEASURED] = levels
        return GiveUp(spec, lease.trial_number, attrs)

    def tell_given_up(self, give_up: GiveUp) -> None:
        study = opt.load_study(self.ctx.storage, give_up.spec)
        try:
            opt.tell_failed(study, give_up.number, give_up.attrs)
        except TrialStateError:
            log.info("trial %d of %s already finished; nothing to fail", give_up.number, give_up.spec.name)


def _levels_measured(s: Session, study: str, number: int) -> list[dict[str, Any]]:
    """The most complete set of levels any attempt of this trial measured before it ended."""
    best: list[dict[str, Any]] = []
    for result in s.scalars(
        select(LeaseRow.result).where(
            LeaseRow.study_name == study, LeaseRow.kind == LeaseKind.TRIAL, LeaseRow.trial_number == number
        )
    ):
        failure = (result or {}).get("failure") or {}
        levels = failure.get("levels") or []
        if len(levels) > len(best):
            best = levels
    return best
