"""The service's `StudyStore` (optimizer/store.py): one study's records in the database.

Optuna's trials live in its own storage (`ctx.storage`); the launched configurations
(spectune_trial_configs), the leases (spectune_leases), the baselines and the events in the
service's tables.  The conductor's actions (optimizer/actions.py) run on this store in the lease
code (api/services/leasing/{trial,confirm}.py), as the rehearsal runs them on the in-memory one.

Writes go to the session it was given (a step the caller holds), or each into a step of its unit.
The service's clock is the database's: where a write stamps a time the store takes it from the
database (`db_now`), as the lease code always has, and the `now` it is passed names the moment
only for stores that have no clock of their own.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import optuna
from optuna.trial import FrozenTrial
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.context import ServiceContext, Unit
from api.db import db_now
from api.models import BaselineRow, LeaseRow, StudyRow, TrialConfigRow
from api.services import lease_rows, study_life, trial_records
from api.services.leasing import records
from api.services.leasing.states import LeaseKind, LeaseState, StudyState, claim, end
from api.services.study_specs import launched_count, load_study, spec_of, study_trials
from optimizer import conductor
from optimizer import study as opt
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from optimizer.store import ConfigState, ConfirmInfo, Deployment, LeaseRecord, NotRecorded, PriorLaunch, QueuedConfirm

log = logging.getLogger("spectune.api.leasing")


def lease_record(r: LeaseRow) -> LeaseRecord:
    """A lease row as the actions carry it out."""
    payload = lease_rows.LeasePayload.of(r)
    is_confirm = r.kind == LeaseKind.CONFIRM
    confirm = payload.confirm.record() if is_confirm and payload.confirm is not None else None
    return LeaseRecord(
        id=r.id,
        kind=r.kind,
        trial_number=r.trial_number,
        config=payload.config,
        config_key=r.config_key,
        attempt=r.attempt,
        worker_id=r.worker_id,
        tier=None if confirm is None else confirm.tier,
        server=payload.server if is_confirm else None,
        confirm=confirm,
    )


class SqlStudyStore:
    """One study's records in the service's database (`spec`: the study, or its name to read it)."""

    def __init__(
        self, ctx: ServiceContext, spec: StudySpec | str, *, unit: Unit | None = None, session: Session | None = None
    ) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self._spec = spec
        self._unit = unit
        self._session = session

    @property
    def name(self) -> str:
        return self._spec if isinstance(self._spec, str) else self._spec.name

    @property
    def spec(self) -> StudySpec:
        if isinstance(self._spec, str):
            with self._write() as s:
                self._spec = spec_of(s, self._spec)
        return self._spec

    @property
    def policy(self) -> Policy:
        # The service runs the default policy: its snapshots (api.services.study_life) carry it.
        return DEFAULT_POLICY

    @contextmanager
    def _write(self) -> Iterator[Session]:
        if self._session is not None:
            yield self._session
        elif self._unit is not None:
            with self._unit.step() as s:
                yield s
        else:
            with self.ctx.unit() as u, u.step() as s:
                yield s

    # ------------------------------------------------------------------ reading

    def study(self) -> optuna.Study:
        # Screened: a quarantined trial steers no proposal (trial_records.sampler_screen).
        return load_study(self.ctx.storage, self.ctx.sessions, self.spec)

    def trials(self) -> list[FrozenTrial]:
        return study_trials(self.ctx.storage, self.ctx.sessions, self.name)

    def snapshot(self, now: datetime, workers: Sequence[str] = ()) -> conductor.Snapshot | None:
        """The study as the conductor sees it (the hosts are the registered workers)."""
        trials = self.trials()  # read before the step (SQLite: Optuna must not wait for our write lock)
        with self._write() as s:
            return study_life.snapshot(s, self.spec, now, trials, self.settings, lock=False)

    def deploy_failures(self) -> list[tuple[SpecConfig, int]]:
        with self._write() as s:
            rows = s.scalars(
                select(LeaseRow).where(
                    LeaseRow.study_name == self.name,
                    LeaseRow.kind == LeaseKind.CONFIRM,
                    LeaseRow.state == LeaseState.FAILED,
                )
            ).all()
            views = []
            for r in rows:
                rec = lease_record(r)
                failure = ((r.result or {}).get("failure") or {}).get("kind")
                views.append(
                    conductor.LeaseView(
                        r.id, LeaseKind(r.kind), LeaseState(r.state), config=rec.config, tier=rec.tier, failure=failure
                    )
                )
        return conductor.deploy_failures(views)

    def levels_measured(self, trial_number: int) -> list[dict[str, Any]]:
        best: list[dict[str, Any]] = []
        with self._write() as s:
            for result in s.scalars(
                select(LeaseRow.result).where(
                    LeaseRow.study_name == self.name,
                    LeaseRow.kind == LeaseKind.TRIAL,
                    LeaseRow.trial_number == trial_number,
                )
            ):
                failure = (result or {}).get("failure") or {}
                levels = failure.get("levels") or []
                if len(levels) > len(best):
                    best = levels
        return best

    # ------------------------------------------------------------------ the study's life

    def persist(self, action: conductor.Action, now: datetime) -> None:
        with self._write() as s:
            study_life.persist(s, self.spec, action, now)

    def settle(self, now: datetime) -> None:
        trials = self.trials()
        with self._write() as s:
            study_life.settle(s, self.spec, db_now(s), trials, self.settings)

    # ------------------------------------------------------------------ trials

    def record_trial(self, asked: opt.AskedTrial, worker_id: str, now: datetime) -> LeaseRecord | PriorLaunch:
        try:
            with self._write() as s:
                lease = self._record(s, worker_id, asked)
                log.info("lease %s: study %s trial %d %s -> %s", lease.id, self.name, asked.number,
                         asked.config.key, worker_id)  # fmt: skip
                return lease_record(lease)
        except IntegrityError:
            with self.ctx.sessions() as s:
                prior = s.scalars(
                    select(TrialConfigRow).where(
                        TrialConfigRow.study_name == self.name, TrialConfigRow.config_key == asked.config.key
                    )
                ).one()
                quarantine = trial_records.quarantined(s, self.name)
            return PriorLaunch(prior.trial_number, ConfigState(prior.state), prior.trial_number in quarantine)

    def _record(self, s: Session, worker_id: str, asked: opt.AskedTrial) -> LeaseRow:
        """Record the asked configuration and its lease in one step; raises IntegrityError for a
        configuration launched before, NotRecorded when the lease cannot be had now."""
        spec = self.spec
        now = db_now(s)
        row = s.get(StudyRow, spec.name)
        if row is None or row.state != StudyState.RUNNING:
            raise NotRecorded("the study stopped or finished while the trial was asked")
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
            raise NotRecorded("budget used by a concurrent ask")
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
            raise NotRecorded("the worker got another lease concurrently", worker_busy=True) from e
        return lease

    def set_config_state(self, config_key: str | None, state: ConfigState) -> None:
        with self._write() as s:
            records.set_config_state(s, self.name, config_key, state)

    def queue_retry(self, lease: LeaseRecord, now: datetime) -> None:
        with self._write() as s:
            s.add(
                lease_rows.new_lease_row(
                    self.spec, LeaseKind.TRIAL, now, self.settings.lease_ttl_s,
                    worker_id=None, config=lease.config, number=lease.trial_number, attempt=lease.attempt + 1,
                )
            )  # fmt: skip

    # ------------------------------------------------------------------ confirmations

    def claim_confirm(
        self, lease: LeaseRecord, action: conductor.Confirm, now: datetime, due: Deployment | None
    ) -> None:
        with self._write() as s:
            row = s.get(LeaseRow, lease.id)
            assert row is not None and lease.confirm is not None
            assert s.get(BaselineRow, action.baseline_id) is not None
            payload = lease_rows.LeasePayload.of(row)
            info = payload.confirm_info.record()
            info = dataclasses.replace(info, baseline_id=action.baseline_id, baseline_fresh=action.fresh_baseline)
            if action.resolve is not None:
                # The conductor's order: more passes on the warm server while the answer straddles a decision.
                payload.resolve = action.resolve
            if due is not None and due[0] != info.tier:
                tier, env = due
                info = dataclasses.replace(info, tier=tier, envelope_note=env.note)
                payload.server = env.settings
            payload.confirm = lease_rows.ConfirmInfo.of_record(info)
            claim(s, row, action.worker_id, now, self.settings.lease_ttl_s, payload=payload.doc())

    def queue_confirm(self, confirm: QueuedConfirm, now: datetime) -> None:
        with self._write() as s:
            study_life.ConfirmRows(s, self.spec).queue_confirm(confirm, now)

    def end_lease(self, lease: LeaseRecord, state: str, now: datetime) -> None:
        with self._write() as s:
            row = s.get(LeaseRow, lease.id)
            assert row is not None
            end(s, row, LeaseState(state), now)

    def requeue_confirm(
        self, lease: LeaseRecord, now: datetime, info: ConfirmInfo, server: ServerSettings | None
    ) -> None:
        """The next attempt of a confirmation, queued for any host (the conductor pairs it again)."""
        with self._write() as s:
            row = s.get(LeaseRow, lease.id)
            assert row is not None
            payload = lease_rows.LeasePayload.of(row)
            payload.confirm = lease_rows.ConfirmInfo.of_record(info)
            if server is not None:
                payload.server = server
            s.add(
                LeaseRow(
                    id=lease_rows.new_lease_id(),
                    study_name=row.study_name,
                    kind=LeaseKind.CONFIRM.value,
                    state=LeaseState.QUEUED.value,
                    worker_id=None,
                    trial_number=row.trial_number,
                    attempt=row.attempt + 1,
                    config_key=row.config_key,
                    payload=payload.doc(),
                    created_at=now,
                )
            )

    def event(self, kind: str, lease: LeaseRecord, detail: str) -> None:
        with self._write() as s:
            row = s.get(LeaseRow, lease.id)
            assert row is not None
            records.event(s, kind, row, detail)
