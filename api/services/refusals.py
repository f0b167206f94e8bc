"""A worker's refusals of studies: recorded as events, standing until its config changes or an
operator clears them.  A study a worker refused is not offered to it while the refusal stands.

Its own module because the lease service records them, while the study's life (which hosts can
confirm), the study document, the fleet and identity changes read or end them.
"""

from __future__ import annotations

import logging

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.db import db_now
from api.models import EventRow, StudyRow
from optimizer.study_state import StudyState

log = logging.getLogger("spectune.api.refusals")

# Event kind recorded when a worker refuses a study's lease; the study is not offered to it again
# while the refusal stands.
LEASE_REFUSED = "lease_refused"
# Event kind that ends every earlier refusal of one worker: its config changed (the digest of its
# allowlist, registry and prompt files in the inventory differs), or an operator cleared them
# (`spectune workers clear-refusals ID`).  The refusals stay in the event log as history.
REFUSALS_CLEARED = "refusals_cleared"


def active_refusals(
    s: Session, *, study: str | None = None, worker_id: str | None = None, open_studies: bool = False
) -> list[EventRow]:
    """The refusals that still stand (no later clear of their worker), oldest first.

    Event ids are the order: two events of one database second are still told apart.
    `open_studies`: only refusals of studies that may still hand out work (running or stopped,
    not finished): the fleet's view, where a refusal of a finished study decides nothing.
    """
    clears = select(EventRow.worker_id, func.max(EventRow.id)).where(EventRow.kind == REFUSALS_CLEARED)
    if worker_id is not None:
        clears = clears.where(EventRow.worker_id == worker_id)
    cleared_at: dict[str | None, int] = {w: i for w, i in s.execute(clears.group_by(EventRow.worker_id))}
    q = select(EventRow).where(EventRow.kind == LEASE_REFUSED)
    if study is not None:
        q = q.where(EventRow.study_name == study)
    if worker_id is not None:
        q = q.where(EventRow.worker_id == worker_id)
    if open_studies:
        finished = select(StudyRow.name).where(StudyRow.state == StudyState.FINISHED)
        q = q.where(EventRow.study_name.not_in(finished))
    return [e for e in s.scalars(q.order_by(EventRow.id)) if e.id > cleared_at.get(e.worker_id, 0)]


def clear_refusals(s: Session, worker_id: str, why: str) -> int:
    """End every refusal of `worker_id` (the studies are offered to it again); how many stood."""
    standing = len(active_refusals(s, worker_id=worker_id))
    if standing:
        s.add(EventRow(at=db_now(s), kind=REFUSALS_CLEARED, worker_id=worker_id, detail=why[:2000]))
        log.info("worker %s: %d refusal(s) cleared: %s", worker_id, standing, why)
    return standing
