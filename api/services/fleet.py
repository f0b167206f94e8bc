"""The fleet view: workers, when they were last seen, what they hold, how they fail, what they refuse.

`spectune workers list` prints it; `workers release` lifts a quarantine and `workers
clear-refusals` ends a worker's refusals (which also end by themselves when the worker's config
digest changes: api.services.leasing.service).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from api.context import ServiceContext
from api.db import db_now
from api.errors import NotFoundError
from api.models import LeaseRow, WorkerRow
from api.services import refusals

RECENT_FAILURES = 5


class FleetService:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def list_workers(self) -> list[dict[str, Any]]:
        with self.ctx.sessions() as s:
            now = db_now(s)
            workers = s.scalars(select(WorkerRow).order_by(WorkerRow.id)).all()
            out = []
            refused: dict[str, list[dict[str, Any]]] = {}
            for e in refusals.active_refusals(s, open_studies=True):
                refused.setdefault(str(e.worker_id), []).append(
                    {"study": e.study_name, "lease_id": e.lease_id, "at": e.at, "message": e.detail}
                )
            for w in workers:
                current = s.scalars(
                    select(LeaseRow).where(LeaseRow.worker_id == w.id, LeaseRow.state == "active")
                ).first()
                failures = s.scalars(
                    select(LeaseRow)
                    .where(LeaseRow.worker_id == w.id, LeaseRow.state.in_(("failed", "expired")))
                    .order_by(LeaseRow.finished_at.desc())
                    .limit(RECENT_FAILURES)
                ).all()
                silent_s = (now - w.last_seen).total_seconds()
                inventory = w.inventory or {}
                out.append(
                    {
                        "id": w.id,
                        "state": "quarantined" if w.quarantined else "ok",
                        # ok | quarantined | silent (no lease call or heartbeat for a lease TTL:
                        # stopped, or cut off from the API)
                        "health": "quarantined"
                        if w.quarantined
                        else "silent"
                        if silent_s > self.ctx.settings.lease_ttl_s
                        else "ok",
                        "quarantine_reason": w.quarantine_reason,
                        "consecutive_host_failures": w.consecutive_host_failures,
                        "last_seen": w.last_seen,
                        "seconds_since_seen": silent_s,
                        "sglang_version": inventory.get("sglang_version"),
                        "config_digest": inventory.get("config_digest"),
                        # Studies this worker refused and is not offered while the refusal stands.
                        "refusals": refused.get(w.id, []),
                        "inventory": w.inventory,
                        "current_lease": None
                        if current is None
                        else {
                            "lease_id": current.id,
                            "study": current.study_name,
                            "kind": current.kind,
                            "trial_number": current.trial_number,
                            "deadline": current.deadline,
                        },
                        "recent_failures": [
                            {
                                "lease_id": f.id,
                                "study": f.study_name,
                                "state": f.state,
                                "kind": ((f.result or {}).get("failure") or {}).get("kind", f.state),
                                "at": f.finished_at,
                            }
                            for f in failures
                        ],
                    }
                )
            return out

    def clear_refusals(self, worker_id: str) -> int:
        """End the worker's refusals: the studies it refused are offered to it again.  How many stood."""
        with self.ctx.unit() as u, u.step() as s:
            if s.get(WorkerRow, worker_id) is None:
                raise NotFoundError(f"no worker {worker_id!r}")
            return refusals.clear_refusals(s, worker_id, "cleared by an operator")

    def release(self, worker_id: str) -> None:
        """Lift a quarantine (after the host was fixed)."""
        with self.ctx.unit() as u, u.step() as s:
            w = s.get(WorkerRow, worker_id)
            if w is None:
                raise NotFoundError(f"no worker {worker_id!r}")
            w.quarantined = False
            w.quarantine_reason = None
            w.consecutive_host_failures = 0
