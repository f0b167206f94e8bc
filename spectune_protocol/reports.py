"""What a worker reports: the measurements of a lease, or why it failed."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from spectune_protocol.fields import IN, MAX_EFFECTIVE_DEPTH, MAX_MS, MAX_TOK_S, Count, Millis, TokS, Version

# The LevelMetrics figures a worker reports pass by pass (`LevelMetrics.runs`).
RunKey = Literal[
    "per_user_tok_s",
    "ttft_ms_p50",
    "ttft_ms_p90",
    "ttft_ms_p99",
    "itl_ms_p50",
    "itl_ms_p90",
    "itl_ms_p99",
    "goodput_req_s",
    "goodput_tok_s",
]
# `refused`: the worker will not run what the *study* asks on this host (a model not in its
# registry, a flag outside its allowlist, a prompt file it lacks, a lease it cannot read).  A
# study fault, never counted against the host: the study is not offered to that worker again.
# `request_rejected`: the engine answered the study's own benchmark requests with HTTP 4xx (a
# prompt longer than the context, sampling parameters it refuses): a study fault, with the spec
# field the engine's answer points at (`SpecField`), never charged to the host (issue 35).
FailureKind = Literal[
    "invalid_config", "oom", "launch_timeout", "crash", "benchmark_error", "lost", "refused", "request_rejected"
]
# The study's fields an engine's 4xx answer can point at (workers/loadgen/rejection.py reads them).
SpecField = Literal["workload.input_len", "workload.output_len", "workload.prompts", "workload"]


class LevelMetrics(BaseModel):
    """Measurements at one concurrency level (aggregated over the workload's repeats)."""

    model_config = IN

    concurrency: int = Field(ge=1, le=4096)
    output_tok_s: TokS = Field(description="aggregate output tokens/s, mean over repeats")
    output_tok_s_runs: list[Annotated[float, Field(ge=0, le=MAX_TOK_S)]] = Field(default_factory=list, max_length=1000)
    per_user_tok_s: float | None = Field(default=None, ge=0, le=MAX_TOK_S)
    ttft_ms_p50: Millis | None = None
    ttft_ms_p90: Millis | None = None
    ttft_ms_p99: Millis | None = None
    itl_ms_p50: Millis | None = None
    itl_ms_p90: Millis | None = None
    itl_ms_p99: Millis | None = None
    # Goodput (LeaseOut.slo): requests/s and output tok/s of the requests meeting the SLO, mean over repeats.
    goodput_req_s: float | None = Field(default=None, ge=0, le=MAX_TOK_S)
    goodput_tok_s: float | None = Field(default=None, ge=0, le=MAX_TOK_S)
    # The per-pass values of the figures above, for the intervals of objectives other than output
    # tok/s (whose passes are `output_tok_s_runs`): per_user_tok_s, ttft_ms_p50 ... goodput_tok_s.
    runs: dict[RunKey, Annotated[list[Annotated[float, Field(ge=0, le=MAX_MS)]], Field(max_length=1000)]] = Field(
        default_factory=dict, max_length=16
    )
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


class VerifyProbePoint(BaseModel):
    """The target's forward over `tokens` new tokens per request, `concurrency` requests at once."""

    model_config = IN

    concurrency: int = Field(ge=1, le=4096)
    tokens: int = Field(ge=1, le=4096)
    seconds: float = Field(ge=0, le=3600, description="median wall seconds of one such forward")
    seconds_runs: list[Annotated[float, Field(ge=0, le=3600)]] = Field(default_factory=list, max_length=100)


class VerifyProbe(BaseModel):
    """Extends of a cached prefix timed on the baseline server (workers/loadgen/probe.py): the
    verify cost's shape, measured without a restart.  `spent_s`: what the probe cost the lease."""

    model_config = IN

    points: list[VerifyProbePoint] = Field(default_factory=list, max_length=1024)
    prefix_tokens: int = Field(ge=0, le=1_000_000)
    cached_share: float | None = Field(default=None, ge=0, le=1)
    spent_s: float = Field(ge=0, le=1e7)
    note: str | None = Field(default=None, max_length=500)


class Metrics(BaseModel):
    model_config = IN

    levels: list[LevelMetrics] = Field(min_length=1, max_length=64)
    startup_s: float | None = Field(default=None, ge=0, le=1e7)
    # What SGLang reported in /server_info after start-up (speculative_* etc.), as it ran.
    effective: dict[str, Any] = Field(default_factory=dict)
    # Pattern-checked: the study document reads it as a version (a bad one once broke every read).
    sglang_version: Version | None = None
    # The end of the server's log, kept as a trial artifact next to the benchmark report.
    log_tail: str = Field(default="", max_length=20_000)
    # Passes added on the warm server to resolve a confirmation (LeaseOut.resolve), per level,
    # and why they stopped; they are in each level's `output_tok_s_runs` too.
    extra_passes: int = Field(default=0, ge=0, le=100_000)
    extra_passes_note: str | None = Field(default=None, max_length=500)
    # A baseline's verify probe (None: not run, e.g. a worker older than the probe).
    verify_probe: VerifyProbe | None = None

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
    model_config = IN

    kind: FailureKind
    message: str = Field(max_length=4000)
    log_tail: str = Field(default="", max_length=20_000)
    # True when the host, not the configuration, is at fault (e.g. argparse rejected a flag name
    # for this SGLang version): then the trial is retried elsewhere and never taught to the sampler.
    host_fault: bool = False
    # `request_rejected`: which of the study's fields the engine's answer points at.
    spec_field: SpecField | None = None
    # Levels measured before the work was interrupted (e.g. the worker shut down mid-benchmark):
    # kept with the trial if it is given up, so a measurement is never thrown away.
    levels: list[LevelMetrics] = Field(default_factory=list, max_length=64)
