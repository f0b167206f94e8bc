"""Leases ended from outside their work: their study stopped or finished, or their worker id was
bound to another token.

Study stopped or finished: they end at the next heartbeat.

A heartbeat used to extend any active lease, so a user's stop (or the study's finish) left its
workers benchmarking for as long as the workload lasted, the host held all the while.  Now the
heartbeat, progress and a worker asking again answer "ended" (409: the worker cancels its work and
stops the engine, workers/heartbeat.py), and the lease ends here under the study's lock, as any
report ends one:

* a trial of a stopped study is queued again (its attempt counted), so a resume measures it;
  a finished study's trial is told FAIL (no one will measure it again);
* a confirmation of a stopped study is queued again, its baseline pairing redone on resume;
* a baseline just ends.

The host is not charged: stopping a study is no fault of the host.

Worker id bound to another token (an admin's `token create --worker-id`): the old token's next
heartbeat, progress or report, or the new token's next ask, ends the lease, and its work is queued
again as for a stopped study (api.services.grants.rebound; issue 35: the new token completed the
old token's lease and the old one still heartbeated it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy.orm import Session

from api.context import ServiceContext
from api.db import REPORT_LOCK_WAIT_MS, db_now, lock_name
from api.models import LeaseRow, StudyRow
from api.services.leasing.confirm import ConfirmLeases
from api.services.leasing.records import event
from api.services.leasing.states import LeaseKind, LeaseState, StudyState, end
from api.services.leasing.trial import GiveUp, TrialLeases
from api.services.study_specs import spec_of
from optimizer import attrs as A

log = logging.getLogger("spectune.api.leasing")

LEASE_ENDED_WITH_STUDY = "lease_ended_with_study"
LEASE_ENDED_BY_BINDING = "lease_ended_by_binding"


def study_state(row: StudyRow | None) -> StudyState | None:
    """The study's state when it no longer hands out work (stopped, finished, gone), else None."""
    if row is None:
        return StudyState.STOPPED  # deleted under the lease: nothing will take its report
    state = StudyState(row.state)
    return None if state == StudyState.RUNNING else state


class LeaseEnding:
    def __init__(self, ctx: ServiceContext, trials: TrialLeases, confirms: ConfirmLeases) -> None:
        self.ctx = ctx
        self.trials = trials
        self.confirms = confirms

    def end_with_study(self, lease_id: str, study: str, state: StudyState) -> None:
        """End a lease of a study that stopped or finished (a no-op if it ended meanwhile, or its
        study runs again): a stopped study's work is queued again for its resume."""
        self._end(
            lease_id, study, f"the study is {state}", LEASE_ENDED_WITH_STUDY,
            requeue=state == StudyState.STOPPED,
            still=lambda s, _lease: study_state(s.get(StudyRow, study)) is not None,
        )  # fmt: skip

    def end_rebound(self, lease_id: str, study: str, still: Callable[[Session, LeaseRow], bool]) -> None:
        """End a lease whose worker id an admin bound to another token since it was granted
        (api.services.grants.rebound): its work is queued again for any worker."""
        why = "its worker id was bound to another token"
        self._end(lease_id, study, why, LEASE_ENDED_BY_BINDING, requeue=True, still=still)

    def _end(
        self,
        lease_id: str,
        study: str,
        why: str,
        kind: str,
        *,
        requeue: bool,
        still: Callable[[Session, LeaseRow], bool],
    ) -> None:
        give_up: GiveUp | None = None
        with self.ctx.unit(lock=f"study:{study}", wait_ms=REPORT_LOCK_WAIT_MS) as u, u.step() as s:
            lock_name(s, f"lease:{lease_id}", REPORT_LOCK_WAIT_MS)
            lease = s.get(LeaseRow, lease_id, with_for_update=True)
            if lease is None or lease.state != LeaseState.ACTIVE or not still(s, lease):
                return
            now = db_now(s)
            end(s, lease, LeaseState.SUPERSEDED, now)
            event(s, kind, lease, why)
            log.info("lease %s of study %s ended: %s", lease_id, study, why)
            if s.get(StudyRow, study) is None:
                return
            if lease.kind == LeaseKind.TRIAL and lease.trial_number is not None:
                spec = spec_of(s, study)
                if requeue:
                    give_up = self.trials.retry_or_fail(s, spec, lease, now, kind, why)
                else:
                    give_up = GiveUp(
                        spec,
                        lease.trial_number,
                        {A.FAILURE_KIND: "study_ended", A.FAILURE_MESSAGE: f"{why}; this trial was not measured"},
                    )
            elif lease.kind == LeaseKind.CONFIRM and requeue:
                self.confirms.retry(s, lease, now, why)
        if give_up is not None:
            self.trials.tell_given_up(give_up)
