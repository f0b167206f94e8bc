"""The wire contract between workers and the API (lease protocol, docs/design.md "Leases").

A package of its own, imported by both sides: the API (`api/`) and the worker (`workers/`), so a
GPU host's worker-only install (`pip install 'spectune[sglang]'`) needs neither the web framework
nor Optuna.  Pure pydantic, plus the typed server settings and configurations of `optimizer`'s
pure modules (`sglang`, `space`, `spec`: no Optuna there).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from optimizer.spec import Workload

LeaseKind = Literal["baseline", "trial", "confirm"]
# `refused`: the worker will not run what the *study* asks on this host (a model not in its
# registry, a flag outside its allowlist, a prompt file it lacks, a lease it cannot read).  A
# study fault, never counted against the host: the study is not offered to that worker again.
FailureKind = Literal["invalid_config", "oom", "launch_timeout", "crash", "benchmark_error", "lost", "refused"]


class GpuInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0, le=1024)
    name: str = Field(max_length=128)
    memory_mib: int = Field(ge=0)


class Inventory(BaseModel):
    """What a worker tells the API about its host each time it asks for work."""

    model_config = ConfigDict(extra="forbid")

    hostname: str = Field(default="", max_length=255)
    gpus: list[GpuInfo] = Field(default_factory=list, max_length=64)
    driver_version: str | None = Field(default=None, max_length=64)
    sglang_version: str = Field(max_length=64)
    models: list[str] = Field(default_factory=list, max_length=1024)
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)
    spectune_version: str | None = Field(default=None, max_length=64)


class LeaseOut(BaseModel):
    """A unit of work: one server launch and benchmark."""

    lease_id: str
    kind: LeaseKind
    study: str
    trial_number: int | None
    attempt: int
    deadline: datetime
    heartbeat_interval_s: float
    server: ServerSettings
    workload: Workload
    config: SpecConfig | None = None


class HeartbeatOut(BaseModel):
    deadline: datetime


class ProgressIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0, le=10_000, description="index of the concurrency level just measured")
    concurrency: int = Field(ge=1)
    output_tok_s: float = Field(ge=0)
    accept_length: float | None = Field(default=None, ge=0)
    phase: str | None = Field(default=None, max_length=64)


class ProgressOut(BaseModel):
    action: Literal["continue", "prune"]


class LevelMetrics(BaseModel):
    """Measurements at one concurrency level (aggregated over the workload's repeats)."""

    model_config = ConfigDict(extra="forbid")

    concurrency: int = Field(ge=1)
    output_tok_s: float = Field(ge=0, description="aggregate output tokens/s, mean over repeats")
    output_tok_s_runs: list[float] = Field(default_factory=list, max_length=1000)
    per_user_tok_s: float | None = Field(default=None, ge=0)
    ttft_ms_p50: float | None = Field(default=None, ge=0)
    ttft_ms_p99: float | None = Field(default=None, ge=0)
    itl_ms_p50: float | None = Field(default=None, ge=0)
    itl_ms_p90: float | None = Field(default=None, ge=0)
    itl_ms_p99: float | None = Field(default=None, ge=0)
    accept_length: float | None = Field(default=None, ge=0)
    completion_tokens: int | None = Field(default=None, ge=0)
    spec_verify_ct: int | None = Field(default=None, ge=0)
    num_requests: int | None = Field(default=None, ge=0)


class Metrics(BaseModel):
    model_config = ConfigDict(extra="forbid")

    levels: list[LevelMetrics] = Field(min_length=1, max_length=64)
    startup_s: float | None = Field(default=None, ge=0)
    # What SGLang reported in /server_info after start-up (speculative_* etc.), as it ran.
    effective: dict[str, Any] = Field(default_factory=dict)
    sglang_version: str | None = Field(default=None, max_length=64)
    # The end of the server's log, kept as a trial artifact next to the benchmark report.
    log_tail: str = Field(default="", max_length=20_000)


class Failure(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: FailureKind
    message: str = Field(max_length=4000)
    log_tail: str = Field(default="", max_length=20_000)
    # True when the host, not the configuration, is at fault (e.g. argparse rejected a flag name
    # for this SGLang version): then the trial is retried elsewhere and never taught to the sampler.
    host_fault: bool = False
    # Levels measured before the work was interrupted (e.g. the worker shut down mid-benchmark):
    # kept with the trial if it is given up, so a measurement is never thrown away.
    levels: list[LevelMetrics] = Field(default_factory=list, max_length=64)


class CompleteIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    outcome: Literal["ok", "failed"]
    metrics: Metrics | None = None
    failure: Failure | None = None


class CompleteOut(BaseModel):
    lease_id: str
    state: str
    speedup: float | None = None
    duplicate: bool = False
