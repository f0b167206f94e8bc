"""The worker side: lease, heartbeat, progress, complete (worker tokens only)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response, status

from api.deps import LeasesDep, PrincipalDep
from api.services import grants
from spectune_protocol import CompleteIn, CompleteOut, HeartbeatOut, Inventory, LeaseOut, ProgressIn, ProgressOut

router = APIRouter(prefix="/v1", tags=["leases"])

# Patterns run in pydantic-core, where `$` is the end of the text (no trailing newline passes).
WorkerId = Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
LeaseId = Annotated[str, Path(pattern=r"^[0-9a-f-]{36}$")]


@router.post(
    "/workers/{worker_id}/lease",
    response_model=LeaseOut,
    responses={204: {"description": "no work for this worker now; ask again later"}},
)
def lease(worker_id: WorkerId, inventory: Inventory, principal: PrincipalDep, leases: LeasesDep) -> LeaseOut | Response:
    out = leases.lease(principal, worker_id, inventory)
    if out is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    # Only the token a lease was handed to may act on it (api.services.grants).
    grants.record_grant(leases.ctx.write_sessions, principal, out.lease_id)
    return out


@router.post("/leases/{lease_id}/heartbeat")
def heartbeat(lease_id: LeaseId, principal: PrincipalDep, leases: LeasesDep) -> HeartbeatOut:
    """Extends the deadline; 410 when the lease expired and was reclaimed, 409 when it ended."""
    return leases.heartbeat(principal, lease_id)


@router.post("/leases/{lease_id}/progress")
def progress(lease_id: LeaseId, body: ProgressIn, principal: PrincipalDep, leases: LeasesDep) -> ProgressOut:
    return leases.progress(principal, lease_id, body)


@router.post("/leases/{lease_id}/complete")
def complete(lease_id: LeaseId, body: CompleteIn, principal: PrincipalDep, leases: LeasesDep) -> CompleteOut:
    """Idempotent: repeating a report returns the stored outcome and changes nothing."""
    return leases.complete(principal, lease_id, body)
