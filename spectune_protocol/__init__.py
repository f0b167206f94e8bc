"""The wire contract between workers and the API (lease protocol, docs/design.md "Leases").

A package of its own, imported by both sides: the API (`api/`) and the worker (`workers/`), so a
GPU host's worker-only install (the wheel with its `sglang` extra) needs neither the web framework
nor Optuna.  Pure pydantic, plus the typed server settings and configurations of `optimizer`'s
pure modules (`sglang`, `space`, `spec`: no Optuna there).
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from optimizer.spec import Workload

# Bounds on what a worker reports.  Every float is finite (NaN and Infinity, incl. JSON's 1e309,
# are refused), and within a range the API can divide and multiply without overflow: throughput
# above a billion tokens/s or latencies above a day are not measurements.  Throughput must be
# positive, since speedups are divided by a baseline's (a baseline of 0 would divide by zero).
MIN_TOK_S = 1e-3
MAX_TOK_S = 1e9
MAX_MS = 86_400_000.0
MAX_COUNT = 10**12
# `effective` (SGLang's /server_info) is nested a few levels; deeper JSON cannot be stored or
# rendered safely (serialisers recurse).
MAX_EFFECTIVE_DEPTH = 16

TokS = Annotated[float, Field(ge=MIN_TOK_S, le=MAX_TOK_S)]
Millis = Annotated[float, Field(ge=0, le=MAX_MS)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
_IN = ConfigDict(extra="forbid", allow_inf_nan=False)

LeaseKind = Literal["baseline", "trial", "confirm"]
# `refused`: the worker will not run what the *study* asks on this host (a model not in its
# registry, a flag outside its allowlist, a prompt file it lacks, a lease it cannot read).  A
# study fault, never counted against the host: the study is not offered to that worker again.
FailureKind = Literal["invalid_config", "oom", "launch_timeout", "crash", "benchmark_error", "lost", "refused"]


class GpuInfo(BaseModel):
    model_config = _IN

    index: int = Field(ge=0, le=1024)
    name: str = Field(max_length=128)
    memory_mib: int = Field(ge=0, le=MAX_COUNT)


class Inventory(BaseModel):
    """What a worker tells the API about its host each time it asks for work."""

    model_config = _IN

    hostname: str = Field(default="", max_length=255)
    gpus: list[GpuInfo] = Field(default_factory=list, max_length=64)
    driver_version: str | None = Field(default=None, max_length=64)
    sglang_version: str = Field(max_length=64)
    models: list[str] = Field(default_factory=list, max_length=1024)
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)
    spectune_version: str | None = Field(default=None, max_length=64)
    # A digest of what decides what this worker refuses (its allowlist of server flags, its model
    # registry, its prompt files): when it changes, the API ends this worker's refusals.
    config_digest: str | None = Field(default=None, pattern=r"^[0-9a-f]{16,64}$")
    # The dataset and prompt files in the worker's prompt folder (plain file names): a study whose
    # workload names a file a worker lacks is not offered to that worker.
    prompt_files: list[Annotated[str, Field(max_length=255)]] = Field(default_factory=list, max_length=1024)


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
    model_config = _IN

    step: int = Field(ge=0, le=10_000, description="index of the concurrency level just measured")
    concurrency: int = Field(ge=1, le=4096)
    output_tok_s: TokS
    accept_length: float | None = Field(default=None, ge=0, le=10_000)
    phase: str | None = Field(default=None, max_length=64)


class ProgressOut(BaseModel):
    action: Literal["continue", "prune"]


class LevelMetrics(BaseModel):
    """Measurements at one concurrency level (aggregated over the workload's repeats)."""

    model_config = _IN

    concurrency: int = Field(ge=1, le=4096)
    output_tok_s: TokS = Field(description="aggregate output tokens/s, mean over repeats")
    output_tok_s_runs: list[Annotated[float, Field(ge=0, le=MAX_TOK_S)]] = Field(default_factory=list, max_length=1000)
    per_user_tok_s: float | None = Field(default=None, ge=0, le=MAX_TOK_S)
    ttft_ms_p50: Millis | None = None
    ttft_ms_p99: Millis | None = None
    itl_ms_p50: Millis | None = None
    itl_ms_p90: Millis | None = None
    itl_ms_p99: Millis | None = None
    accept_length: float | None = Field(default=None, ge=0, le=10_000)
    completion_tokens: Count | None = None
    spec_verify_ct: Count | None = None
    num_requests: Count | None = None
    # Why this level is not a measurement: the load generator or the host could not keep up
    # (workers/loadgen/saturation.py); None when its checks passed.  Such a level was measured
    # twice on the same server; its figure is kept but no interval is derived from it.
    saturated: str | None = Field(default=None, max_length=2000)
    # What those checks read: the generator's CPU demand, send lag, the engine's running requests.
    load_check: dict[str, Annotated[float, Field(ge=0, le=1e9)] | None] = Field(default_factory=dict, max_length=16)


class Metrics(BaseModel):
    model_config = _IN

    levels: list[LevelMetrics] = Field(min_length=1, max_length=64)
    startup_s: float | None = Field(default=None, ge=0, le=1e7)
    # What SGLang reported in /server_info after start-up (speculative_* etc.), as it ran.
    effective: dict[str, Any] = Field(default_factory=dict)
    sglang_version: str | None = Field(default=None, max_length=64)
    # The end of the server's log, kept as a trial artifact next to the benchmark report.
    log_tail: str = Field(default="", max_length=20_000)

    @field_validator("effective")
    @classmethod
    def _plain_json(cls, v: dict[str, Any]) -> dict[str, Any]:
        problem = json_problem(v, MAX_EFFECTIVE_DEPTH)
        if problem is not None:
            raise ValueError(problem)
        return v


def json_problem(value: Any, max_depth: int) -> str | None:
    """Why `value` is not plain, finite, shallow JSON (None when it is).  Iterative: no recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > max_depth:
                return f"nested deeper than {max_depth} levels"
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
        elif isinstance(node, float) and not math.isfinite(node):
            return "numbers must be finite (no NaN or Infinity)"
        elif isinstance(node, int) and not isinstance(node, bool) and abs(node) > 2**63:
            return "integers must fit in 64 bits"
    return None


class Failure(BaseModel):
    model_config = _IN

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
    model_config = _IN

    outcome: Literal["ok", "failed"]
    metrics: Metrics | None = None
    failure: Failure | None = None


class CompleteOut(BaseModel):
    lease_id: str
    state: str
    speedup: float | None = None
    duplicate: bool = False
