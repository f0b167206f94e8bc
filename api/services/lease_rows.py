"""A lease row as both the lease service and a study's life make one: its kinds and states, what a
worker needs to run it (the payload), and the one builder.

Outside api/services/leasing/ because study_life queues a study's confirmations as leases while
the lease service carries out study_life's actions: each imports this, neither the other.  The
moves between states are leasing/states.py's.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from api.models import LeaseRow
from optimizer.objective import slo_of
from optimizer.plan import server_settings, workload_doc
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec


class LeaseKind(StrEnum):
    BASELINE = "baseline"
    TRIAL = "trial"
    CONFIRM = "confirm"


class LeaseState(StrEnum):
    QUEUED = "queued"
    ACTIVE = "active"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    SUPERSEDED = "superseded"


def lease_payload(spec: StudySpec, config: SpecConfig | None, **extra: Any) -> dict[str, Any]:
    """What a worker needs to run a lease: server settings, workload and configuration."""
    return {
        "server": server_settings(spec, config).model_dump(mode="json"),
        "workload": workload_doc(spec.workload),
        "config": None if config is None else config.model_dump(mode="json"),
        # Only a goodput objective sends one: every other lease's payload is as before.
        **({"slo": slo} if (slo := slo_of(spec.objective)) is not None else {}),
        **extra,
    }


def new_lease_id() -> str:
    return str(uuid.uuid4())


def new_lease_row(
    spec: StudySpec,
    kind: LeaseKind,
    now: datetime,
    ttl_s: float,
    *,
    worker_id: str | None,
    config: SpecConfig | None,
    number: int | None,
    attempt: int = 1,
    payload: dict[str, Any] | None = None,
) -> LeaseRow:
    """A new lease: active for `worker_id`, or queued for any worker when it is None."""
    active = worker_id is not None
    return LeaseRow(
        id=new_lease_id(),
        study_name=spec.name,
        kind=kind.value,
        state=(LeaseState.ACTIVE if active else LeaseState.QUEUED).value,
        worker_id=worker_id,
        trial_number=number,
        attempt=attempt,
        config_key=None if config is None else config.key,
        payload=payload if payload is not None else lease_payload(spec, config),
        created_at=now,
        leased_at=now if active else None,
        deadline=now + timedelta(seconds=ttl_s) if active else None,
    )
