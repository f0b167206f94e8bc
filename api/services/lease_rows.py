"""A lease row as both the lease service and a study's life make one: its kinds and states, what a
worker needs to run it (the payload), and the one builder.

Outside api/services/leasing/ because study_life queues a study's confirmations as leases while
the lease service carries out study_life's actions: each imports this, neither the other.  The
moves between states are leasing/states.py's.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import cast

from pydantic import BaseModel, ConfigDict, JsonValue

from api.models import LeaseRow
from optimizer.objective import slo_of
from optimizer.plan import server_settings, workload_doc
from optimizer.spec import StudySpec
from optimizer.store import ConfirmInfo as ConfirmRecord

# Defined once, in the wire package (a worker reads a lease's kind too); imported from here by
# the lease service and study_life as before.
from spectune_protocol import LeaseKind as LeaseKind
from spectune_protocol import LeaseState as LeaseState
from spectune_protocol import Resolve, ServerSettings, Slo, SpecConfig, Workload


class ConfirmInfo(BaseModel):
    """A confirm lease's bookkeeping, stored with its payload and never sent to the worker.

    Each key is in the stored JSON only where it was written (`LeasePayload.doc`): an adaptive
    proof has no `tier`, and `baseline_id` / `baseline_fresh` come when a worker claims it.
    Keys of another release are kept as they were."""

    model_config = ConfigDict(extra="allow")

    adaptive: bool | None = None  # True for the adaptive proof (no tier: no smaller envelope)
    avoid_worker: str | None = None  # confirm elsewhere than where it was found
    search_speedup: float | None = None  # what the search measured
    tier: int | None = None  # the deployment envelope it is queued or launched in
    envelope_note: str | None = None
    baseline_id: int | None = None  # the baseline it is paired with, once claimed
    baseline_fresh: bool | None = None

    @property
    def launch_tier(self) -> int | None:
        """The envelope it launches in: None for the adaptive proof (it has none), or where none was stored."""
        return None if self.adaptive or self.tier is None else self.tier

    def record(self) -> ConfirmRecord:
        """As the actions carry it (optimizer.store.ConfirmInfo), the keys of another release kept."""
        return ConfirmRecord.from_json(self.model_dump(mode="json", exclude_unset=True))

    @classmethod
    def of_record(cls, record: ConfirmRecord) -> ConfirmInfo:
        """Back from the actions' record, stored as the record writes it (optimizer.store.ConfirmInfo.as_json)."""
        return cls.model_validate(record.as_json())


class LeasePayload(BaseModel):
    """What a lease row stores to run it: what the worker receives (spectune_protocol.LeaseOut
    adds the lease's id, kind, study and deadline), and a confirmation's bookkeeping."""

    model_config = ConfigDict(extra="allow")

    server: ServerSettings
    workload: Workload
    config: SpecConfig | None = None
    # Only a goodput objective sends one: every other lease's payload is as before.
    slo: Slo | None = None
    resolve: Resolve | None = None
    confirm: ConfirmInfo | None = None

    @classmethod
    def of(cls, row: LeaseRow) -> LeasePayload:
        """The one reader of a lease row's payload column (api/models.py keeps it as JSON): every
        other read goes through this model, and tests/api/test_typed_payloads.py fails on a raw one."""
        return cls.model_validate(row.payload)

    @property
    def confirm_info(self) -> ConfirmInfo:
        """The confirmation's bookkeeping, empty where the lease has none (a trial or baseline)."""
        return self.confirm if self.confirm is not None else ConfirmInfo()

    def doc(self) -> dict[str, JsonValue]:
        """The stored JSON: the settings and configuration whole, the workload in the form baseline
        keys hash (optimizer.plan.workload_doc), the optional parts only where they were set."""
        out: dict[str, JsonValue] = self.model_dump(mode="json", exclude_unset=True)
        out["server"] = self.server.model_dump(mode="json")
        out["workload"] = cast(JsonValue, workload_doc(self.workload))
        out["config"] = None if self.config is None else self.config.model_dump(mode="json")
        for part in ("slo", "resolve"):
            model = getattr(self, part)
            if model is not None:
                out[part] = model.model_dump(mode="json")
        return out


def lease_payload(spec: StudySpec, config: SpecConfig | None, *, confirm: ConfirmInfo | None = None) -> LeasePayload:
    """What a worker needs to run a lease: server settings, workload and configuration."""
    slo = slo_of(spec.objective)
    payload = LeasePayload(server=server_settings(spec, config), workload=spec.workload, config=config)
    if slo is not None:
        payload.slo = Slo.model_validate(slo)
    if confirm is not None:
        payload.confirm = confirm
    return payload


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
    payload: LeasePayload | None = None,
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
        payload=(payload if payload is not None else lease_payload(spec, config)).doc(),
        created_at=now,
        leased_at=now if active else None,
        deadline=now + timedelta(seconds=ttl_s) if active else None,
    )
