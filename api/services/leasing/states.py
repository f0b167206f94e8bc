"""The life of a lease, as one explicit state machine.

    queued ──claim──▶ active ──report ok──▶ completed
      │                 │ ├──report failed──▶ failed
      │                 │ ├──deadline passed──▶ expired ──late report──▶ completed | failed
      │                 │ └──its trial finished elsewhere, its study stopped or finished, or its
      │                 │    worker id was bound to another token (ending.py)──▶ superseded
      └──its trial finished elsewhere──▶ superseded

Every move is a guarded compare-and-set (`UPDATE … WHERE id = :id AND state = :from`) inside the
caller's transaction, so two API processes (or two threads on SQLite) can never both move one
lease: the loser gets `LeaseRaceError` and its transaction is rolled back.  The database holds the
same vocabulary as CHECK constraints (migrations/versions/0002_state_checks.py).

Invariants the lease service keeps with these moves (tests/benchmarks/test_lease_stress.py checks them on
database snapshots while workers run):
* an active trial lease's Optuna trial is RUNNING: a trial that finishes ends its live leases in
  the same step (`supersede_live`), and a lease found out of step is superseded before it is
  handed back to its worker (`LeaseService.lease`);
* a lease id is handed out to one worker, once: an ended lease never becomes active again, and a
  retry is a new lease with a new id and attempt + 1;
* a configuration is never answered as a duplicate of its own trial.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from api.errors import ConflictError
from api.models import LeaseRow
from api.services.lease_rows import LeaseKind as LeaseKind  # defined with the row it builds
from api.services.lease_rows import LeaseState as LeaseState
from optimizer.store import ConfigState as ConfigState  # the actions'; re-exported for the lease code
from optimizer.study_state import StudyState as StudyState  # the conductor's; re-exported for the lease code

LIVE = (LeaseState.QUEUED, LeaseState.ACTIVE)

TRANSITIONS: dict[LeaseState, frozenset[LeaseState]] = {
    # queued -> failed: a confirmation whose every remaining envelope is known to run out of
    # memory ends without a launch (ConfirmLeases.claim).
    LeaseState.QUEUED: frozenset({LeaseState.ACTIVE, LeaseState.SUPERSEDED, LeaseState.FAILED}),
    LeaseState.ACTIVE: frozenset({LeaseState.COMPLETED, LeaseState.FAILED, LeaseState.EXPIRED, LeaseState.SUPERSEDED}),
    LeaseState.EXPIRED: frozenset({LeaseState.COMPLETED, LeaseState.FAILED}),
    LeaseState.COMPLETED: frozenset(),
    LeaseState.FAILED: frozenset(),
    LeaseState.SUPERSEDED: frozenset(),
}


class LeaseRaceError(ConflictError):
    """Another request moved this lease first; this one's transaction must not go on."""


class WorkerHoldsLeaseError(ConflictError):
    """A concurrent request of the same worker got it a lease first (one active lease per worker)."""


class IllegalTransitionError(ConflictError):
    """A move the state machine does not allow (e.g. re-activating an ended lease)."""


def move(s: Session, lease: LeaseRow, to: LeaseState, **values: Any) -> None:
    """Move `lease` to `to`, setting `values` too, if and only if it is still in its current state.

    `lease.state` is the state this request read; the UPDATE matches only while the row is
    still in it.  The in-memory row is updated to match.
    """
    current = LeaseState(lease.state)
    if to not in TRANSITIONS[current]:
        raise IllegalTransitionError(f"lease {lease.id} is {current.value}; it cannot become {to.value}")
    s.flush()  # pending changes of this row first, so the UPDATE below sees them
    result = s.execute(
        update(LeaseRow)
        .where(LeaseRow.id == lease.id, LeaseRow.state == current.value)
        .values(state=to.value, **values)
        .execution_options(synchronize_session=False)
    )
    if getattr(result, "rowcount", 0) != 1:
        raise LeaseRaceError(f"lease {lease.id} changed meanwhile (it is no longer {current.value}); ask again")
    # Keep the row object in step without a round trip (the ORM must not write these again).
    set_committed_value(lease, "state", to.value)
    for key, value in values.items():
        set_committed_value(lease, key, value)


def claim(s: Session, lease: LeaseRow, worker_id: str, now: datetime, ttl_s: float, **values: Any) -> None:
    """queued -> active for `worker_id`, with a deadline `ttl_s` from `now` (database clock).

    WorkerHoldsLeaseError when the worker got another active lease meanwhile (the partial unique
    index); the savepoint keeps the caller's transaction usable.
    """
    try:
        with s.begin_nested():
            move(
                s,
                lease,
                LeaseState.ACTIVE,
                worker_id=worker_id,
                leased_at=now,
                deadline=now + timedelta(seconds=ttl_s),
                **values,
            )
    except IntegrityError as e:
        raise WorkerHoldsLeaseError("this worker already holds an active lease; ask again") from e


def end(s: Session, lease: LeaseRow, to: LeaseState, now: datetime, **values: Any) -> None:
    """Move a lease to an ended state, stamping `finished_at`."""
    move(s, lease, to, finished_at=now, **values)
