"""The worker side: lease, heartbeat, progress, complete (worker tokens only)."""

from __future__ import annotations

import json
from functools import partial
from typing import Annotated, TypeVar

import anyio
import anyio.to_thread
from fastapi import APIRouter, Path, Request, Response, status

from api.deps import LeasesDep, PrincipalDep
from api.errors import BusyError
from api.services import grants
from spectune_protocol import (
    STANDING_HEADER,
    CompleteIn,
    CompleteOut,
    HeartbeatOut,
    Inventory,
    LeaseOut,
    ProgressIn,
    ProgressOut,
    WorkerStanding,
)

router = APIRouter(prefix="/v1", tags=["leases"])

# Patterns run in pydantic-core, where `$` is the end of the text (no trailing newline passes).
WorkerId = Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
LeaseId = Annotated[str, Path(pattern=r"^[0-9a-f-]{36}$")]

T = TypeVar("T")


async def _protocol_thread(request: Request, fn: partial[T]) -> T:
    """Runs a protocol call in the protocol's own threads (api.app: a report may wait for its
    study's lock, and reads must not queue behind such waits).

    A call whose thread or stream was closed under it (the server shutting down while the call
    waited on a lock: an unhandled ClosedResourceError on a busy machine, issue 35) is answered
    as busy, 503 with Retry-After: the worker asks again (a lease handed out meanwhile is handed
    back to it, a report already stored is answered as a repeat).
    """
    try:
        return await anyio.to_thread.run_sync(fn, limiter=request.app.state.protocol_threads)
    except anyio.ClosedResourceError as e:
        raise BusyError("the API closed this call while it waited; retry shortly") from e


@router.post(
    "/workers/{worker_id}/lease",
    response_model=LeaseOut,
    responses={204: {"description": "no work for this worker now; ask again later"}},
)
async def lease(
    request: Request,
    response: Response,
    worker_id: WorkerId,
    inventory: Inventory,
    principal: PrincipalDep,
    leases: LeasesDep,
) -> LeaseOut | Response:
    def run() -> tuple[LeaseOut | None, WorkerStanding]:
        out = leases.lease(principal, worker_id, inventory)
        if out is not None:
            # Only the token a lease was handed to may act on it (api.services.grants).
            grants.record_grant(leases.ctx.write_sessions, principal, out.lease_id)
        return out, leases.standing(worker_id)

    out, standing = await _protocol_thread(request, partial(run))
    # What the fleet decided about the worker rides on every answer, a 204 too (no body there).
    headers = {STANDING_HEADER: json.dumps(standing.model_dump(mode="json"), ensure_ascii=True)}
    if out is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT, headers=headers)
    response.headers.update(headers)
    return out


@router.post("/leases/{lease_id}/heartbeat")
async def heartbeat(request: Request, lease_id: LeaseId, principal: PrincipalDep, leases: LeasesDep) -> HeartbeatOut:
    """Extends the deadline; 410 when the lease expired and was reclaimed, 409 when it ended."""
    return await _protocol_thread(request, partial(leases.heartbeat, principal, lease_id))


@router.post("/leases/{lease_id}/progress")
async def progress(
    request: Request, lease_id: LeaseId, body: ProgressIn, principal: PrincipalDep, leases: LeasesDep
) -> ProgressOut:
    return await _protocol_thread(request, partial(leases.progress, principal, lease_id, body))


@router.post("/leases/{lease_id}/complete")
async def complete(
    request: Request, lease_id: LeaseId, body: CompleteIn, principal: PrincipalDep, leases: LeasesDep
) -> CompleteOut:
    """Idempotent: repeating a report returns the stored outcome and changes nothing."""
    return await _protocol_thread(request, partial(leases.complete, principal, lease_id, body))
