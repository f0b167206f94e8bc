"""What the fleet decided about a worker, sent with every lease answer (a header)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from spectune_protocol.fields import OUT, Plain, StudyName

# The header of every lease answer (a 204 has no body) carrying what the fleet decided about the
# worker, so its own log can say it (workers/agent.py): JSON of `WorkerStanding`, ASCII only.
STANDING_HEADER = "Spectune-Worker-Standing"
MAX_STANDING_REFUSALS = 20


class RefusedStudy(BaseModel):
    model_config = OUT

    study: StudyName
    reason: Plain


class WorkerStanding(BaseModel):
    """What the fleet decided about this worker: its quarantine (with the reason) and the studies
    it is no longer offered because it refused them.  Each ends by an admin's command, which the
    worker's log names (`spectune workers release ID`, `spectune workers clear-refusals ID`)."""

    model_config = OUT

    quarantined: Plain | None = None
    refused: list[RefusedStudy] = Field(default_factory=list, max_length=MAX_STANDING_REFUSALS)
