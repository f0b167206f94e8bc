"""The fleet view: workers, when they were last seen, what they hold, how they fail."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from api.context import ServiceContext
from api.db import db_now
from api.errors import NotFoundError
from api.models import LeaseRow, WorkerRow

RECENT_FAILURES = 5


class FleetService:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def list_workers(self) -> list[dict[str, Any]]:
        with self.ctx.sessions() as s:
            now = db_now(s)
            workers = s.scalars(select(WorkerRow).order_by(WorkerRow.id)).all()
            out = []
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
                out.append(
                    {
                        "id": w.id,
                        "state": "quarantined" if w.quarantined else "ok",
                        "quarantine_reason": w.quarantine_reason,
                        "last_seen": w.last_seen,
                        "seconds_since_seen": (now - w.last_seen).total_seconds(),
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

    def release(self, worker_id: str) -> None:
        """Lift a quarantine (after the host was fixed)."""
        with self.ctx.unit() as u, u.step() as s:
            w = s.get(WorkerRow, worker_id)
            if w is None:
                raise NotFoundError(f"no worker {worker_id!r}")
            w.quarantined = False
            w.quarantine_reason = None
            w.consecutive_host_failures = 0
