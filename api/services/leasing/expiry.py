"""Leases whose worker went silent, and Optuna trials that no lease will ever finish."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from api.context import ServiceContext
from api.db import db_now
from api.errors import BusyError
from api.models import EventRow, LeaseRow, StudyRow, WorkerRow
from api.optuna_tables import running_trials_started_before
from api.services import study_life
from api.services.leasing.confirm import ConfirmLeases
from api.services.leasing.records import HostHealth, event
from api.services.leasing.states import LIVE, LeaseKind, LeaseState, StudyState, end
from api.services.leasing.trial import GiveUp, TrialLeases
from api.services.study_specs import spec_of, study_trials
from api.settings import Settings
from optimizer import attrs as A

log = logging.getLogger("spectune.api.leasing")


def lost_after_s(settings: Settings) -> float:
    """Silence (database clock) after which a worker holding a lease is lost: its heartbeats missed."""
    return settings.lost_after_beats * settings.heartbeat_interval_s


def _gone(now: datetime, settings: Settings) -> ColumnElement[bool]:
    """An active lease past its deadline, or whose worker is lost: it sent nothing (heartbeat, ask)
    for `lost_after_s`, where it beats every `heartbeat_interval_s` (the interval its lease
    carries).  The worker row's `last_seen` is one value every API process writes on the database
    clock, so any process decides the same."""
    silent = select(WorkerRow.id).where(WorkerRow.last_seen < now - timedelta(seconds=lost_after_s(settings)))
    return or_(LeaseRow.deadline < now, LeaseRow.worker_id.in_(silent))


class Expiry:
    def __init__(self, ctx: ServiceContext, health: HostHealth, trials: TrialLeases, confirms: ConfirmLeases) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.health = health
        self.trials = trials
        self.confirms = confirms

    def reclaim_expired(self) -> int:
        """Expire leases past their deadline or whose worker is lost (database clock); re-queue or
        fail their trials, so another worker takes the work on its next ask.

        Study by study, each under its study's lock taken first, as a report and an ask take it:
        expiry wrote lease rows and then waited for the study's row to settle it, the lock order
        that deadlocked the report path on Postgres (b6da51c).  A study another request holds is
        passed over; the next sweep (every ask runs one) takes it.
        """
        with self.ctx.sessions() as s:
            now = db_now(s)
            studies = sorted(
                set(
                    s.scalars(
                        select(LeaseRow.study_name).where(
                            LeaseRow.state == LeaseState.ACTIVE, _gone(now, self.settings)
                        )
                    )
                )
            )
        reclaimed = 0
        for name in studies:
            try:
                reclaimed += self._reclaim_study(name)
            except BusyError:
                log.info("study %s busy; its expired leases wait for the next sweep", name)
        self.fail_orphans()
        return reclaimed

    def _reclaim_study(self, name: str) -> int:
        give_ups: list[GiveUp] = []
        with self.ctx.unit(lock=f"study:{name}", wait_ms=0) as u:
            with u.step() as s:
                now = db_now(s)
                expired = s.scalars(
                    select(LeaseRow)
                    .where(LeaseRow.study_name == name, LeaseRow.state == LeaseState.ACTIVE, _gone(now, self.settings))
                    .with_for_update(skip_locked=True)
                ).all()
                seen = {
                    w.id: w.last_seen
                    for w in s.scalars(select(WorkerRow).where(WorkerRow.id.in_({x.worker_id for x in expired})))
                }
                settle = False
                spec = spec_of(s, name) if any(x.kind != LeaseKind.BASELINE for x in expired) else None
                for lease in expired:
                    last_seen = None if lease.worker_id is None else seen.get(lease.worker_id)
                    why = _why_gone(lease, last_seen, now, self.settings)
                    end(s, lease, LeaseState.EXPIRED, now)
                    event(s, "lease_expired", lease, why)
                    if lease.worker_id is not None:
                        self.health.failure(s, lease.worker_id, f"lease expired without a report: {why}")
                    if lease.kind == LeaseKind.BASELINE or spec is None:
                        continue
                    settle = True
                    if lease.kind == LeaseKind.TRIAL and lease.trial_number is not None:
                        message = "the worker sent no heartbeat before the lease's deadline"
                        give_up = self.trials.retry_or_fail(s, spec, lease, now, "lease_expired", message)
                        if give_up is not None:
                            give_ups.append(give_up)
                    elif lease.kind == LeaseKind.CONFIRM:
                        self.confirms.retry(s, lease, now, f"lease expired: {why}")
            for give_up in give_ups:
                self.trials.tell_given_up(give_up)
            if settle and spec is not None:
                snapshot = study_trials(self.ctx.storage, self.ctx.sessions, spec.name)
                with u.step() as s:
                    study_life.settle(s, spec, db_now(s), snapshot, self.settings)
        return len(expired)

    def fail_orphans(self) -> None:
        """Fail trials Optuna handed out whose lease was never recorded.

        `TrialLeases.ask_new` asks Optuna (committed at once) and then records the lease; an API
        process or a database that dies in between leaves a RUNNING trial no lease will ever
        finish, which constant-liar TPE would count as a pessimistic guess forever and which
        would keep its study from finishing.  A RUNNING trial without a queued or active lease
        that is older than `orphan_grace_s` (asks take milliseconds) is told FAIL, then the
        study may finish.
        """
        with self.ctx.sessions() as s:
            now = db_now(s)
            names = set(s.scalars(select(StudyRow.name).where(StudyRow.state == StudyState.RUNNING)))
        # One query over every study (api.optuna_tables): loading each running study's trials
        # through Optuna on every lease cost ~0.1 s per study, 30 s per lease at 300 studies.
        grace = timedelta(seconds=self.settings.orphan_grace_s)
        stale = running_trials_started_before(self.ctx.rdb.engine, now - grace)
        storage = self.ctx.storage
        for name, old in sorted(stale.items()):
            if name not in names:
                continue
            with self.ctx.sessions() as s:
                held = set(
                    s.scalars(
                        select(LeaseRow.trial_number).where(
                            LeaseRow.study_name == name,
                            LeaseRow.kind == LeaseKind.TRIAL,
                            LeaseRow.state.in_(LIVE),
                        )
                    )
                )
                spec = spec_of(s, name)
            orphans = [number for number in old if number not in held]
            for number in orphans:
                log.warning("study %s: trial %d was asked but never leased; telling it FAIL", name, number)
                message = "asked from Optuna but never leased (the API or database failed in between)"
                self.trials.tell_given_up(
                    GiveUp(spec, number, {A.FAILURE_KIND: "not_leased", A.FAILURE_MESSAGE: message})
                )
            if orphans:
                snapshot = study_trials(storage, self.ctx.sessions, name)
                try:
                    # Under the study's lock, as every settle; a busy study settles on its own.
                    with self.ctx.unit(lock=f"study:{name}", wait_ms=0) as u, u.step() as s:
                        study_life.settle(s, spec, db_now(s), snapshot, self.settings)
                except BusyError:
                    log.info("study %s busy; it settles with its next report or ask", name)


def _why_gone(lease: LeaseRow, last_seen: datetime | None, now: datetime, settings: Settings) -> str:
    """Why an active lease ends unreported, in words (its event, and the study document's `waiting`)."""
    if last_seen is not None and last_seen < now - timedelta(seconds=lost_after_s(settings)):
        silent = (now - last_seen).total_seconds()
        beats = silent / settings.heartbeat_interval_s
        return (
            f"worker {lease.worker_id} lost: nothing heard for {silent:.1f} s "
            f"({beats:.1f} heartbeat intervals of {settings.heartbeat_interval_s:g} s)"
        )
    return f"no heartbeat since deadline {lease.deadline}"


_KIND_WORDS = {LeaseKind.BASELINE: "baseline", LeaseKind.TRIAL: "trial", LeaseKind.CONFIRM: "confirmation"}


def lost_work_note(s: Session, study: str, now: datetime) -> str | None:
    """Why a running study runs nothing, when the last thing it ran was lost (None otherwise).

    "waiting: confirmation lease of gpu-3 lost 40 s ago (...); reassigning": the study document's
    `waiting`, so a study whose worker died never shows "running" with nothing running and no word.
    """
    if s.scalar(select(LeaseRow.id).where(LeaseRow.study_name == study, LeaseRow.state == LeaseState.ACTIVE).limit(1)):
        return None
    last = s.scalars(
        select(LeaseRow)
        .where(LeaseRow.study_name == study, LeaseRow.finished_at.is_not(None))
        .order_by(LeaseRow.finished_at.desc())
        .limit(1)
    ).first()
    if last is None or last.state != LeaseState.EXPIRED or last.finished_at is None:
        return None
    detail = s.scalar(
        select(EventRow.detail)
        .where(EventRow.lease_id == last.id, EventRow.kind == "lease_expired")
        .order_by(EventRow.at.desc())
        .limit(1)
    )
    ago = max(0.0, (now - last.finished_at).total_seconds())
    why = f" ({detail})" if detail else ""
    return (
        f"waiting: {_KIND_WORDS.get(LeaseKind(last.kind), last.kind)} lease of {last.worker_id} lost {ago:.0f} s ago"
        f"{why}; reassigning to the next eligible worker that asks"
    )
