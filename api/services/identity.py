"""Worker identity: a worker id is bound to one worker token on first use.

Seen (issue 18): an unbound worker token leased as another worker's id; it received that worker's
live lease, overwrote its inventory, and its forged baseline (0.5 tok/s) was used for the real
worker's trials in six studies, its forged crashes quarantined the host and a forged refusal kept
a study from it for good.  Now:

* a token bound by an admin (`spectune token create --worker-id ID`) acts only as ID, and no
  other token may use ID while it is live;
* an unbound worker token takes a free id the first time it asks for work with it, up to
  `max_worker_ids_per_token` ids; another token asking as that id gets 403;
* when the holder is revoked (a host's token rotated), the next token to use the id takes it
  over: the id's standing refusals end, its failure count restarts, and baselines measured before
  the move no longer count (`baselines_since`).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.auth import Principal, require_worker
from api.db import db_now
from api.errors import ForbiddenError, LimitReachedError
from api.models import ApiToken, EventRow, WorkerIdentity, WorkerRow
from api.services import refusals

IDENTITY_MOVED = "worker_identity_moved"


def _taken(worker_id: str) -> ForbiddenError:
    return ForbiddenError(
        f"worker id {worker_id!r} belongs to another worker token; give this host its own id "
        "(or ask an admin to revoke the other token if this host replaces it)"
    )


def claim(s: Session, principal: Principal, worker_id: str, limit: int) -> None:
    """Allow `principal` to act as `worker_id`, binding a free id to it; ForbiddenError otherwise."""
    require_worker(principal, worker_id)
    if principal.worker_id is not None:
        return  # bound by an admin: the token names its one id
    if _live_bound_token(s, worker_id) is not None:
        raise _taken(worker_id)
    row = s.get(WorkerIdentity, worker_id)
    if row is None:
        held = s.scalar(
            select(func.count()).select_from(WorkerIdentity).where(WorkerIdentity.token_id == principal.token_id)
        )
        if (held or 0) >= limit:
            raise LimitReachedError(
                f"this worker token already speaks for {held} worker ids, the limit "
                f"(SPECTUNE_MAX_WORKER_IDS_PER_TOKEN={limit}); give each host its own token "
                "(`spectune token create --role worker --worker-id ID`)",
                field="worker_id",
            )
        try:
            with s.begin_nested():
                s.add(WorkerIdentity(worker_id=worker_id, token_id=principal.token_id, bound_at=db_now(s)))
                s.flush()
            return
        except IntegrityError:  # a concurrent first use of the same id
            row = s.get(WorkerIdentity, worker_id, populate_existing=True)
            assert row is not None
    if row.token_id == principal.token_id:
        return
    holder = s.get(ApiToken, row.token_id)
    if holder is not None and holder.revoked_at is None:
        raise _taken(worker_id)
    _move(s, row, principal, db_now(s))


def live_bound_tokens(s: Session, worker_id: str) -> set[int]:
    """The live tokens an admin bound to `worker_id` (usually one)."""
    return set(s.scalars(select(ApiToken.id).where(ApiToken.worker_id == worker_id, ApiToken.revoked_at.is_(None))))


def _live_bound_token(s: Session, worker_id: str) -> int | None:
    return s.scalars(
        select(ApiToken.id).where(ApiToken.worker_id == worker_id, ApiToken.revoked_at.is_(None)).limit(1)
    ).first()


def _move(s: Session, row: WorkerIdentity, principal: Principal, now: datetime) -> None:
    """The holder was revoked: the id passes to `principal`, and what the old token recorded
    as this worker (refusals, failure count, baselines) stops counting."""
    old = row.token_id
    row.token_id = principal.token_id
    row.bound_at = now
    row.moved_at = now
    refusals.clear_refusals(s, row.worker_id, f"worker id moved from revoked token {old} to token {principal.token_id}")
    worker = s.get(WorkerRow, row.worker_id)
    if worker is not None:
        worker.consecutive_host_failures = 0
    s.add(
        EventRow(
            at=now,
            kind=IDENTITY_MOVED,
            worker_id=row.worker_id,
            detail=f"from revoked token {old} to token {principal.token_id} ({principal.name})"[:2000],
        )
    )


def may_act_as(s: Session, principal: Principal, worker_id: str | None) -> bool:
    """Does `worker_id` belong to `principal` (for heartbeat, progress and complete)?"""
    if principal.role != "worker" or worker_id is None:
        return False
    if principal.worker_id is not None:
        return principal.worker_id == worker_id
    row = s.get(WorkerIdentity, worker_id)
    # No row: a lease from before identities (migration 0005 binds the ids it can); the grant decides.
    return row is None or row.token_id == principal.token_id
