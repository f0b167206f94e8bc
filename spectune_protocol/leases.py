"""A lease, as the API hands it to a worker, and the worker's calls while it holds one."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from spectune_protocol.fields import (
    IN,
    MAX_HEARTBEAT_S,
    MAX_MS,
    MAX_RESOLVE_THRESHOLD,
    MAX_TOK_S,
    MIN_HEARTBEAT_S,
    OUT,
    LeaseId,
    Plain,
    StudyName,
    TokS,
    Word,
)
from spectune_protocol.reports import Failure, Metrics
from spectune_protocol.server import ServerSettings
from spectune_protocol.speculative import SpecConfig
from spectune_protocol.workload import Workload


class LeaseKind(StrEnum):
    """What a lease asks of a worker: measure the server without speculation (the reference every
    speedup is measured against), a trial of the search, or a confirmation of a candidate."""

    BASELINE = "baseline"
    TRIAL = "trial"
    CONFIRM = "confirm"


class LeaseState(StrEnum):
    """Where a lease is in its life (api/services/leasing/states.py holds the moves between them)."""

    QUEUED = "queued"
    ACTIVE = "active"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    SUPERSEDED = "superseded"

    @property
    def live(self) -> bool:
        """Queued or running: not ended."""
        return self in (LeaseState.QUEUED, LeaseState.ACTIVE)


class Resolve(BaseModel):
    """Measure more passes on the warm server while a confirmation straddles a decision.

    Sent with a confirm lease (issue 17 item 4): after its levels, the worker keeps the server up
    and adds passes at `levels` while the objective's 95% interval (against the paired baseline's
    passes, widened by the study's launch noise `extra_var`) holds one of `thresholds`, until it
    clears them, more passes could no longer clear them, or `max_passes` extra passes per level.
    """

    levels: list[Annotated[int, Field(ge=1, le=4096)]] = Field(max_length=64)
    # The objective's level, or None: the geometric mean over `levels`.
    objective_concurrency: int | None = None
    baseline_runs: dict[str, list[Annotated[float, Field(ge=0, le=MAX_TOK_S)]]] = Field(max_length=64)
    thresholds: list[Annotated[float, Field(gt=0, le=MAX_RESOLVE_THRESHOLD)]] = Field(max_length=16)
    extra_var: float = Field(ge=0, le=10)
    max_passes: int = Field(ge=0, le=1000)


class Slo(BaseModel):
    """The limits a request must meet to count towards goodput (a study whose objective is goodput).

    A request meets them when its time to first token is at most `ttft_ms` and its time per
    output token after the first (its mean inter-token latency, DistServe's TPOT) at most
    `itl_ms`; either may be None: no limit.  Per request the mean, not a percentile of its own
    gaps: speculation streams a cycle's tokens together, so one request's gaps are bursty by design.
    """

    ttft_ms: float | None = Field(default=None, gt=0, le=MAX_MS)
    itl_ms: float | None = Field(default=None, gt=0, le=MAX_MS)


class LeaseOut(BaseModel):
    """A unit of work: one server launch and benchmark."""

    model_config = OUT

    lease_id: LeaseId
    kind: LeaseKind
    study: StudyName
    trial_number: int | None = Field(ge=0, le=10**9)
    attempt: int = Field(ge=1, le=1000)
    deadline: datetime
    heartbeat_interval_s: float = Field(ge=MIN_HEARTBEAT_S, le=MAX_HEARTBEAT_S)
    server: ServerSettings
    workload: Workload
    config: SpecConfig | None = None
    resolve: Resolve | None = None
    # Set when the study's objective is goodput: the worker counts the requests meeting it.
    slo: Slo | None = None


class HeartbeatOut(BaseModel):
    model_config = OUT

    deadline: datetime


class ProgressIn(BaseModel):
    model_config = IN

    step: int = Field(ge=0, le=10_000, description="index of the concurrency level just measured")
    concurrency: int = Field(ge=1, le=4096)
    output_tok_s: TokS
    accept_length: float | None = Field(default=None, ge=0, le=10_000)
    phase: Word | None = None  # the lease kind; a word, so it cannot forge a log line


class ProgressOut(BaseModel):
    model_config = OUT

    action: Literal["continue", "prune"]


class CompleteIn(BaseModel):
    model_config = IN

    outcome: Literal["ok", "failed"]
    metrics: Metrics | None = None
    failure: Failure | None = None


class CompleteOut(BaseModel):
    model_config = OUT

    lease_id: Plain = Field(max_length=64)  # an echo of the request's id, never used in a path
    state: Word
    speedup: float | None = Field(default=None, ge=0, le=1e12)
    duplicate: bool = False
