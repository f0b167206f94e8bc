"""/v1/workers: the fleet."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.auth import require_role
from api.deps import FleetDep, PrincipalDep, UserDep

router = APIRouter(prefix="/v1/workers", tags=["fleet"])


@router.get("")
def list_workers(_: UserDep, fleet: FleetDep) -> list[dict[str, Any]]:
    return fleet.list_workers()


@router.post("/{worker_id}/release", status_code=204)
def release_worker(worker_id: str, principal: PrincipalDep, fleet: FleetDep) -> None:
    """Lift a quarantine (admin only)."""
    require_role(principal, "admin")
    fleet.release(worker_id)


@router.post("/{worker_id}/refusals/clear")
def clear_refusals(worker_id: str, principal: PrincipalDep, fleet: FleetDep) -> dict[str, int]:
    """End a worker's refusals, so the studies it refused are offered to it again (admin only).

    Refusals also end by themselves when the worker's config digest changes (its allowlist,
    registry or prompt files); this is for a fix the digest cannot see.
    """
    require_role(principal, "admin")
    return {"cleared": fleet.clear_refusals(worker_id)}
