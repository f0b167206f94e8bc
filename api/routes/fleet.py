"""/v1/workers: the fleet."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, JsonValue

from api.auth import require_role
from api.deps import FleetDep, PrincipalDep, UserDep
from api.documents import UtcDatetime
from spectune_protocol import LeaseKind, LeaseState

router = APIRouter(prefix="/v1/workers", tags=["fleet"])


# What `GET /v1/workers` answers per worker (api.services.fleet.Fleet.list_workers builds it).  The
# field order is the JSON's; times are the database's UTC, sent with their offset (RFC 3339, as the
# schema states and the study documents send them: before the fleet was typed they had none).
class Refusal(BaseModel):
    """A study this worker refused and is not offered while the refusal stands."""

    study: str | None
    lease_id: str | None
    at: UtcDatetime
    message: str


class CurrentLease(BaseModel):
    lease_id: str
    study: str
    kind: LeaseKind
    trial_number: int | None
    deadline: UtcDatetime | None


class RecentFailure(BaseModel):
    lease_id: str
    study: str
    state: LeaseState
    kind: str  # the failure's kind as the worker reported it (spectune_protocol.FailureKind), else the state
    at: UtcDatetime | None


class WorkerView(BaseModel):
    id: str
    state: Literal["ok", "quarantined"]
    # ok | quarantined | silent (no lease call or heartbeat for a lease TTL: stopped, or cut off
    # from the API)
    health: Literal["ok", "quarantined", "silent"]
    quarantine_reason: str | None
    consecutive_host_failures: int
    last_seen: UtcDatetime
    seconds_since_seen: float
    sglang_version: str | None
    config_digest: str | None
    refusals: list[Refusal]
    # The worker's last inventory as stored (spectune_protocol.Inventory when it was sent; kept
    # as the JSON it was, so an inventory stored by an older worker is shown as it is).
    inventory: dict[str, JsonValue] | None
    current_lease: CurrentLease | None
    recent_failures: list[RecentFailure]


class RefusalsCleared(BaseModel):
    cleared: int  # how many refusals stood


@router.get("")
def list_workers(_: UserDep, fleet: FleetDep) -> list[WorkerView]:
    return [WorkerView.model_validate(w) for w in fleet.list_workers()]


@router.post("/{worker_id}/release", status_code=204)
def release_worker(worker_id: str, principal: PrincipalDep, fleet: FleetDep) -> None:
    """Lift a quarantine (admin only)."""
    require_role(principal, "admin")
    fleet.release(worker_id)


@router.post("/{worker_id}/refusals/clear")
def clear_refusals(worker_id: str, principal: PrincipalDep, fleet: FleetDep) -> RefusalsCleared:
    """End a worker's refusals, so the studies it refused are offered to it again (admin only).

    Refusals also end by themselves when the worker's config digest changes (its allowlist,
    registry or prompt files); this is for a fix the digest cannot see.
    """
    require_role(principal, "admin")
    return RefusalsCleared(cleared=fleet.clear_refusals(worker_id))
