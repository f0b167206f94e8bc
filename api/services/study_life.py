"""The one place a study's life is decided: load its snapshot, ask the conductor, persist the answer.

`optimizer.conductor` decides (pure); this module reads what it needs from the database into a
`Snapshot` under the study's row lock, and writes the study-level decisions back: the move to
confirmation (its confirm leases, the phase, why the search ended), the finish, and a user's
stop and resume.  The lease
service carries out the worker-level actions (a baseline, a retry, a confirmation, an ask).

Optuna's trials are read by the caller before its write step opens (`study_specs.study_trials`):
on SQLite, calling Optuna while holding the write lock would wait for ourselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from optuna.trial import FrozenTrial
from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from api.errors import ConflictError
from api.models import ApiToken, EventRow, LeaseRow, StudyRow, TrialConfigRow, WorkerIdentity, WorkerRow
from api.services.eligibility import requirements_unmet
from api.services.launch_noise import confirm_measurement
from api.services.lease_rows import ConfirmInfo, LeaseKind, LeasePayload, LeaseState, lease_payload, new_lease_row
from api.services.refusals import active_refusals
from api.services.study_specs import study_baselines
from api.settings import Settings
from optimizer import actions
from optimizer import conductor as c
from optimizer.errors import StudyNotFoundError
from optimizer.spec import StudySpec
from optimizer.store import QueuedConfirm
from optimizer.study_state import Ending, FinishReason, Phase, StudyState

log = logging.getLogger("spectune.api.studies")


def timing(settings: Settings) -> c.Timing:
    return c.Timing(
        baseline_max_age_s=settings.baseline_max_age_s,
        live_window_s=3 * settings.lease_ttl_s,
        confirm_idle_s=settings.confirm_baseline_idle_s,
    )


def ending_of(row: StudyRow) -> Ending | None:
    """Why the study's search ended, as stored (None while it searches)."""
    if row.finish_rule is None or row.finish_reason is None:
        return None
    return Ending(FinishReason(row.finish_rule), row.finish_reason)


# The search's ending of a study stopped while it confirmed: `finish_rule`/`finish_reason` then
# say "stopped by a user", so the search's own ending is kept here for `resume` to put back
# (without it the conductor would finish the confirmations with an ending nobody decided).
SEARCH_ENDING_KEPT = "search_ending_kept"


def keep_search_ending(s: Session, row: StudyRow, now: datetime) -> None:
    """Before a stop overwrites it: the ending of a study's search, while it confirms."""
    ending = ending_of(row)
    if row.phase != Phase.CONFIRMATION or ending is None:
        return
    s.add(
        EventRow(at=now, kind=SEARCH_ENDING_KEPT, study_name=row.name, detail=f"{ending.reason.value}: {ending.detail}")
    )


def kept_search_ending(s: Session, name: str) -> Ending | None:
    """The search ending `keep_search_ending` kept last for this study (None when none was)."""
    detail = s.scalars(
        select(EventRow.detail)
        .where(EventRow.study_name == name, EventRow.kind == SEARCH_ENDING_KEPT)
        .order_by(EventRow.id.desc())
        .limit(1)
    ).first()
    if detail is None:
        return None
    rule, _, reason = detail.partition(": ")
    return Ending(FinishReason(rule), reason)


def snapshot(
    s: Session, spec: StudySpec, now: datetime, trials: Sequence[FrozenTrial], settings: Settings, *, lock: bool = True
) -> c.Snapshot | None:
    """The study as the conductor sees it (the study's row locked for this transaction when `lock`)."""
    row = s.get(StudyRow, spec.name, with_for_update=lock)
    if row is None:
        return None
    leases = [
        c.LeaseView(
            id=r.id,
            kind=LeaseKind(r.kind),
            state=LeaseState(r.state),
            trial_number=r.trial_number,
            worker_id=r.worker_id,
            config_key=r.config_key,
            created_at=r.created_at,
            leased_at=r.leased_at,
            finished_at=r.finished_at,
            avoid_worker=LeasePayload.of(r).confirm_info.avoid_worker if r.kind == LeaseKind.CONFIRM else None,
            measurement=_measurement(r),
            independent=not ((r.result or {}).get("confirmation") or {}).get("not_independent"),
            **_deployment(r),
        )
        for r in s.scalars(
            select(LeaseRow).where(
                LeaseRow.study_name == spec.name,
                or_(LeaseRow.kind == LeaseKind.CONFIRM, LeaseRow.state.in_(("queued", "active"))),
            )
        )
    ]
    baselines = study_baselines(s, spec)
    refused = {e.worker_id for e in active_refusals(s, study=spec.name)}
    # When each worker last had a lease reclaimed unreported (any study): one not heard from since
    # is lost, and no confirmation waits for it (api.services.leasing.expiry).
    lost_at = dict(
        s.execute(
            select(LeaseRow.worker_id, func.max(LeaseRow.finished_at))
            .where(LeaseRow.state == LeaseState.EXPIRED, LeaseRow.worker_id.is_not(None))
            .group_by(LeaseRow.worker_id)
        ).all()
    )
    tokens = worker_tokens(s)
    hosts = [
        c.HostView(
            w.id,
            w.last_seen,
            quarantined=w.quarantined,
            eligible=not requirements_unmet(spec, w.inventory or {}),
            refused=w.id in refused,
            lost=_lost(lost_at.get(w.id), w.last_seen),
            token=tokens.get(w.id),
        )
        for w in s.scalars(select(WorkerRow))
    ]
    launched = frozenset(
        s.scalars(select(TrialConfigRow.config_key).where(TrialConfigRow.study_name == spec.name)).all()
    )
    search_done = {
        w: at
        for w, at in s.execute(
            select(LeaseRow.worker_id, func.max(LeaseRow.finished_at))
            .where(
                LeaseRow.study_name == spec.name, LeaseRow.kind == LeaseKind.TRIAL, LeaseRow.finished_at.is_not(None)
            )
            .group_by(LeaseRow.worker_id)
        )
        if w is not None and at is not None
    }
    return c.Snapshot(
        spec=spec,
        state=StudyState(row.state),
        phase=Phase(row.phase or Phase.SEARCH),
        created_at=row.created_at,
        now=now,
        trials=trials,
        launched=launched,
        leases=leases,
        baselines=baselines,
        hosts=hosts,
        timing=timing(settings),
        confirmation_began_at=row.confirmation_began_at,
        ending=ending_of(row),
        search_done=search_done,
    )


def _lost(reclaimed: datetime | None, last_seen: datetime | None) -> bool:
    """A lease of the worker was reclaimed unreported, and nothing was heard from it since."""
    return reclaimed is not None and (last_seen is None or reclaimed >= last_seen)


def worker_tokens(s: Session) -> dict[str, int]:
    """The token that speaks for each worker id: bound by an admin, or claimed on first use."""
    out = {w: t for w, t in s.execute(select(WorkerIdentity.worker_id, WorkerIdentity.token_id))}
    bound = select(ApiToken.worker_id, ApiToken.id).where(
        ApiToken.worker_id.is_not(None), ApiToken.revoked_at.is_(None)
    )
    out |= {w: t for w, t in s.execute(bound) if w is not None}
    return out


def _deployment(r: LeaseRow) -> dict[str, Any]:
    """A confirm lease's deployment as the conductor weighs it: configuration, tier, server, failure."""
    if r.kind != LeaseKind.CONFIRM:
        return {}
    payload = LeasePayload.of(r)
    return {
        "config": payload.config,
        "tier": payload.confirm_info.launch_tier,
        "server": payload.server,
        "failure": ((r.result or {}).get("failure") or {}).get("kind") if r.state == "failed" else None,
    }


def _measurement(r: LeaseRow) -> tuple[list[Any], list[Any]] | None:
    if r.kind != LeaseKind.CONFIRM or r.state != "completed":
        return None
    m = confirm_measurement(r)
    return None if m is None else (m[1], m[2])


def settle(s: Session, spec: StudySpec, now: datetime, trials: Sequence[FrozenTrial], settings: Settings) -> None:
    """After a result, an expiry or a given-up ask: has the study's life moved on?  Persisted here."""
    snap = snapshot(s, spec, now, trials, settings)
    if snap is None:
        return
    persist(s, spec, c.settle(snap), now)


def next_for(
    s: Session,
    spec: StudySpec,
    worker_id: str,
    now: datetime,
    trials: Sequence[FrozenTrial],
    settings: Settings,
    *,
    spare: bool = True,
) -> c.Action:
    """The conductor's next action for this worker; the study-level ones already persisted.

    A study that moves to confirmation is asked again at once: it may have a confirmation (or a
    baseline before one) for this worker.  `spare`: no other study has work for the worker
    (`optimizer.conductor.next_action`).
    """
    action: c.Action = c.Wait("the study is gone")
    for _ in range(2):
        snap = snapshot(s, spec, now, trials, settings)
        if snap is None:
            return c.Wait("the study is gone")
        action = c.next_action(snap, worker_id, spare=spare)
        persist(s, spec, action, now)
        if not isinstance(action, c.StartConfirmation | c.Reconfirm):
            return action
    return action


def _stop(s: Session, row: StudyRow, ending: Ending, now: datetime) -> None:
    """Running -> stopped, the search's ending kept first when it confirms (`resume` puts it back)."""
    keep_search_ending(s, row, now)
    row.state = StudyState.STOPPED.value
    row.finished_at = now
    row.finish_rule = ending.reason.value
    row.finish_reason = ending.detail[:256]


def stop_for_fault(s: Session, spec: StudySpec, ending: Ending, now: datetime) -> bool:
    """Stop a running study whose own settings fail (optimizer.conductor.baseline_fault)."""
    row = s.get(StudyRow, spec.name, with_for_update=True)
    if row is None or row.state != StudyState.RUNNING:
        return False
    _stop(s, row, ending, now)
    log.info("study %s stopped (%s): %s", spec.name, ending.reason.value, ending.detail)
    return True


def _locked(s: Session, name: str) -> StudyRow:
    row = s.get(StudyRow, name, with_for_update=True)
    if row is None:
        raise StudyNotFoundError(name)
    return row


def stop_by_user(s: Session, name: str, now: datetime) -> StudyRow:
    """A user's stop: running -> stopped (stopping twice is harmless; a finished study stays finished)."""
    row = _locked(s, name)
    if row.state == StudyState.RUNNING:
        _stop(s, row, Ending(FinishReason.STOPPED_BY_USER, "stopped by a user"), now)
    elif row.state != StudyState.STOPPED:
        raise ConflictError(f"study {name!r} is already {row.state}")
    return row


# How to search further, by why the study finished: the spec field that would have let it go on.
_EXTEND = {
    FinishReason.CONVERGED: "budget.min_gain lower, or budget.converge: false to spend the whole budget",
    FinishReason.DOES_NOT_PAY: "budget.converge: false to spend the whole budget anyway",
    FinishReason.MAX_TRIALS: "budget.max_trials higher",
    FinishReason.MAX_HOURS: "budget.max_hours higher",
    FinishReason.PATIENCE: "budget.patience higher, or none",
    FinishReason.SPACE_EXHAUSTED: "a wider search_space",
}


def finished_resume_message(name: str, rule: str | None, reason: str | None) -> str:
    """Why a finished study cannot be resumed, why it finished, and how to search further."""
    why = f" ({reason})" if reason else ""
    try:
        ending = FinishReason(rule) if rule else None
    except ValueError:
        ending = None
    head = (
        f"study {name!r} converged{why}: nothing left was likely to beat its answer by budget.min_gain"
        if ending == FinishReason.CONVERGED
        else f"study {name!r} is finished{why}"
    )
    change = _EXTEND.get(ending) if ending is not None else None
    how = f" with {change}" if change else ""
    return (
        f"{head}; a finished study is not resumed. To search further, create a new study of the same "
        f"model{how}: it starts from this one's answers"
    )


def resume(s: Session, name: str, admit: Callable[[StudyRow], None]) -> StudyRow:
    """Stopped -> running; `admit` may refuse it first (the owner's running-study limit).

    The budget rules then apply as before (max_hours counts from creation).  Stopped while
    confirming: it goes on confirming and ends with its search's own ending (kept by the stop),
    not one made up; otherwise it searches again.
    """
    row = _locked(s, name)
    if row.state == StudyState.FINISHED:
        raise ConflictError(finished_resume_message(name, row.finish_rule, row.finish_reason))
    if row.state != StudyState.STOPPED:
        return row  # running already
    admit(row)
    kept = kept_search_ending(s, name) if row.phase == Phase.CONFIRMATION else None
    row.state = StudyState.RUNNING.value
    row.finished_at = None
    row.finish_reason = None if kept is None else kept.detail
    row.finish_rule = None if kept is None else kept.reason.value
    return row


def persist(s: Session, spec: StudySpec, action: c.Action, now: datetime) -> None:
    """Write a study-level decision (`StartConfirmation`, `Finish`); others change nothing here."""
    if not isinstance(action, c.StartConfirmation | c.Reconfirm | c.Finish):
        return
    row = s.get(StudyRow, spec.name, with_for_update=True)
    if row is None or row.state != StudyState.RUNNING:
        return
    if isinstance(action, c.Finish):
        row.state = StudyState.FINISHED.value
        row.finished_at = now
        row.finish_rule = action.reason.value
        row.finish_reason = action.detail[:256]
        log.info("study %s finished (%s): %s", spec.name, action.reason.value, action.detail)
        return
    actions.queue_confirmations(ConfirmRows(s, spec), action.candidates, now)
    if isinstance(action, c.Reconfirm):
        # More launches of candidates already confirmed: the phase and the search's ending stay.
        s.flush()
        log.info("study %s: one more confirmation launch (%s)", spec.name, action.why)
        return
    row.phase = Phase.CONFIRMATION.value
    row.confirmation_began_at = now
    row.finish_rule = action.ending.reason.value
    row.finish_reason = action.ending.detail[:256]
    s.flush()
    log.info("study %s: %s; confirming %d candidate(s)", spec.name, action.ending.detail, len(action.candidates))


class ConfirmRows:
    """Queued confirm leases written in the caller's session (optimizer.store.ConfirmQueue): what
    to queue is optimizer.actions.queue_confirmations's."""

    def __init__(self, s: Session, spec: StudySpec) -> None:
        self.s = s
        self.spec = spec

    def queue_confirm(self, confirm: QueuedConfirm, now: datetime) -> None:
        info = ConfirmInfo.model_validate(confirm.info.as_json())  # the keys written are the keys stored
        payload = lease_payload(self.spec, confirm.config, confirm=info).model_copy(
            update={"server": confirm.envelope.settings}
        )
        row = new_lease_row(
            self.spec, LeaseKind.CONFIRM, now, 0.0,
            worker_id=None, config=confirm.config, number=confirm.trial_number, payload=payload,
        )  # fmt: skip
        row.config_key = confirm.config_key
        self.s.add(row)
