"""Which worker token a lease was handed to, so that a token acts only on its own leases.

A worker token bound to a worker id (`token create --worker-id`) may act only on that worker's
leases.  An unbound worker token may lease as any worker id, but once a lease is handed to it,
only it may heartbeat, progress or complete that lease: the lease route records the grant, and
`may_act` checks it.  "Not yours" and "no such lease" get one and the same answer (404), so a
token learns nothing about other workers' leases.
"""

from __future__ import annotations

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from api.auth import Principal
from api.db import db_now, transaction
from api.errors import NotFoundError
from api.models import ApiToken, LeaseGrant, LeaseRow
from api.services import identity


def not_yours(lease_id: str) -> NotFoundError:
    """The one answer for a lease that does not exist or is not this token's to act on."""
    return NotFoundError(f"no lease {lease_id} held by this worker token")


def record_grant(factory: sessionmaker[Session], principal: Principal, lease_id: str) -> None:
    """Remember that `lease_id` was handed to `principal`'s token (the first token keeps it).

    A lease handed out again (the worker asked while holding it) keeps its grant, unless that
    token was revoked since: then the token that asks now, e.g. a host's rotated token, takes it.
    """
    try:
        with transaction(factory) as s:
            grant = s.get(LeaseGrant, lease_id)
            if grant is None:
                s.add(LeaseGrant(lease_id=lease_id, token_id=principal.token_id, granted_at=db_now(s)))
            elif grant.token_id != principal.token_id:
                holder = s.get(ApiToken, grant.token_id)
                if holder is None or holder.revoked_at is not None:
                    grant.token_id = principal.token_id
    except IntegrityError:
        pass  # a concurrent request of the same lease recorded it first


def may_act(s: Session, principal: Principal, lease: LeaseRow) -> bool:
    """May this worker token heartbeat, progress or complete this lease?"""
    if principal.role != "worker":
        return False
    if principal.worker_id is not None:
        return lease.worker_id == principal.worker_id and not rebound(s, lease)
    grant = s.get(LeaseGrant, lease.id)
    # The grant, and the worker id's identity (api.services.identity): both must be this token's.
    return (
        grant is not None
        and grant.token_id == principal.token_id
        and identity.may_act_as(s, principal, lease.worker_id)
        and not rebound(s, lease)
    )


def granted_to(s: Session, principal: Principal, lease: LeaseRow) -> bool:
    """Was `lease` handed to this very token?"""
    grant = s.get(LeaseGrant, lease.id)
    return grant is not None and grant.token_id == principal.token_id


def rebound(s: Session, lease: LeaseRow) -> bool:
    """Was `lease` granted to a token other than the live ones its worker id is bound to now?

    An admin bound the id (`token create --worker-id`) after the lease was handed out: neither the
    token it was handed to nor the new one may act on it; the lease service ends it
    (leasing/ending.py).  Seen (issue 35): the new token completed the old token's lease (200)
    and the old one still heartbeated it.
    """
    if lease.worker_id is None:
        return False
    grant = s.get(LeaseGrant, lease.id)
    if grant is None:
        return False  # a lease from before grants: the worker id decides
    bound = identity.live_bound_tokens(s, lease.worker_id)
    return bool(bound) and grant.token_id not in bound
