"""Leases of a study that stopped or finished while they ran: they end at the next heartbeat.

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
"""

from __future__ import annotations

import logging

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


def study_state(row: StudyRow | None) -> StudyState | None:
    """The study's state when it no longer hands out work (stopped, finished, gone), else None."""
    if row is None:
        return StudyState.STOPPED  # deleted under the lease: nothing will take its report
    state = StudyState(row.state)
    return None if state == StudyState.RUNNING else state


class EndedStudyLeases:
    def __init__(self, ctx: ServiceContext, trials: TrialLeases, confirms: ConfirmLeases) -> None:
        self.ctx = ctx
        self.trials = trials
        self.confirms = confirms

    def end(self, lease_id: str, study: str, state: StudyState) -> None:
        """End `lease_id` (a no-op if it ended meanwhile, or its study runs again)."""
        give_up: GiveUp | None = None
        with self.ctx.unit(lock=f"study:{study}", wait_ms=REPORT_LOCK_WAIT_MS) as u, u.step() as s:
            lock_name(s, f"lease:{lease_id}", REPORT_LOCK_WAIT_MS)
            lease = s.get(LeaseRow, lease_id, with_for_update=True)
            row = s.get(StudyRow, study)
            if lease is None or lease.state != LeaseState.ACTIVE or study_state(row) is None:
                return
            now = db_now(s)
            end(s, lease, LeaseState.SUPERSEDED, now)
            why = f"the study is {state}"
            event(s, LEASE_ENDED_WITH_STUDY, lease, why)
            log.info("lease %s of study %s ended: %s", lease_id, study, why)
            if row is None:
                return
            if lease.kind == LeaseKind.TRIAL and lease.trial_number is not None:
                spec = spec_of(s, study)
                if state == StudyState.STOPPED:
                    give_up = self.trials.retry_or_fail(s, spec, lease, now, "study_stopped", why)
                else:
                    give_up = GiveUp(
                        spec,
                        lease.trial_number,
                        {A.FAILURE_KIND: "study_ended", A.FAILURE_MESSAGE: f"{why}; this trial was not measured"},
                    )
            elif lease.kind == LeaseKind.CONFIRM and state == StudyState.STOPPED:
                self.confirms.retry(s, lease, now, why)
        if give_up is not None:
            self.trials.tell_given_up(give_up)
