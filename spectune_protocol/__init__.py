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

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from optimizer.spec import LABEL_KEY_RE, LABEL_VALUE_RE, MODEL_NAME_RE, NAME_RE, Workload

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


def _anchored(pattern: str) -> str:
    """A `re` pattern ending in `\\Z` as pydantic-core wants it (`^...$`, where `$` is the very end)."""
    return "^" + pattern.removesuffix(r"\Z") + "$"


# Every text field is pattern-checked, both ways: what a worker reports is stored and shown, and
# what the API sends a worker is logged there and acted on.  No field can carry a newline (a
# forged log line), a control character or an unbounded amount of text.
# A version as SGLang and pip write them ("0.5.23", "v0.5.3rc0", "0.5.10.post1"):
# optimizer.sglang.parse_version reads every text this pattern admits.
VERSION_PATTERN = r"^v?\d{1,4}\.\d{1,4}\.\d{1,6}[A-Za-z0-9.+-]{0,32}$"
Version = Annotated[str, StringConstraints(pattern=VERSION_PATTERN)]
ModelName = Annotated[str, StringConstraints(pattern=_anchored(MODEL_NAME_RE.pattern))]
LabelKey = Annotated[str, StringConstraints(pattern=_anchored(LABEL_KEY_RE.pattern))]
LabelValue = Annotated[str, StringConstraints(pattern=_anchored(LABEL_VALUE_RE.pattern))]
# Printable text without control characters (GPU names, host names).
Plain = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x1f\x7f]{0,255}$")]
Word = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,63}$")]
# A plain file name of a worker's prompt folder, as a workload names it (optimizer.spec.Workload).
PromptFile = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")]
StudyName = Annotated[str, StringConstraints(pattern=_anchored(NAME_RE.pattern))]
# The API's lease ids are uuid4s; any id a worker puts in a URL path is one plain segment.
LeaseId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
# Models a worker names in its inventory, and labels: enough for any real host, and an inventory
# stays a few tens of kB (150 ids x 1 MB inventories once made `GET /v1/workers` 145 MiB).
MAX_MODELS = 256
MAX_LABELS = 72  # 64 from the worker's config, plus the derived gpu_model and gpu_count
# What the API may ask of a worker's heartbeat: never a busy loop, never a silence of hours.
MIN_HEARTBEAT_S = 0.05
MAX_HEARTBEAT_S = 3600.0
# The speedups a confirmation's extra passes resolve against (Resolve.thresholds): no real
# speedup is near it; a larger stored one (a forged report, issue 35) is no threshold to resolve.
MAX_RESOLVE_THRESHOLD = 1000.0

TokS = Annotated[float, Field(ge=MIN_TOK_S, le=MAX_TOK_S)]
Millis = Annotated[float, Field(ge=0, le=MAX_MS)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
_IN = ConfigDict(extra="forbid", allow_inf_nan=False)
# What the API sends: unknown fields are ignored (a newer API), but no number may be NaN or Infinity.
_OUT = ConfigDict(allow_inf_nan=False)

LeaseKind = Literal["baseline", "trial", "confirm"]
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


class GpuInfo(BaseModel):
    model_config = _IN

    index: int = Field(ge=0, le=1024)
    name: Plain = Field(max_length=128)
    memory_mib: int = Field(ge=0, le=MAX_COUNT)


class Inventory(BaseModel):
    """What a worker tells the API about its host each time it asks for work."""

    model_config = _IN

    hostname: Plain = Field(default="", max_length=255)
    gpus: list[GpuInfo] = Field(default_factory=list, max_length=64)
    driver_version: Word | None = None
    sglang_version: Version
    models: list[ModelName] = Field(default_factory=list, max_length=MAX_MODELS)
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=MAX_LABELS)
    spectune_version: Word | None = None
    # A digest of what decides what this worker refuses (its allowlist of server flags, its model
    # registry, its prompt files): when it changes, the API ends this worker's refusals.
    config_digest: str | None = Field(default=None, pattern=r"^[0-9a-f]{16,64}$")
    # The dataset and prompt files in the worker's prompt folder (plain file names): a study whose
    # workload names a file a worker lacks is not offered to that worker.
    prompt_files: list[PromptFile] = Field(default_factory=list, max_length=1024)


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

    model_config = _OUT

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


# The header of every lease answer (a 204 has no body) carrying what the fleet decided about the
# worker, so its own log can say it (workers/agent.py): JSON of `WorkerStanding`, ASCII only.
STANDING_HEADER = "Spectune-Worker-Standing"
MAX_STANDING_REFUSALS = 20


class RefusedStudy(BaseModel):
    model_config = _OUT

    study: StudyName
    reason: Plain


class WorkerStanding(BaseModel):
    """What the fleet decided about this worker: its quarantine (with the reason) and the studies
    it is no longer offered because it refused them.  Each ends by an admin's command, which the
    worker's log names (`spectune workers release ID`, `spectune workers clear-refusals ID`)."""

    model_config = _OUT

    quarantined: Plain | None = None
    refused: list[RefusedStudy] = Field(default_factory=list, max_length=MAX_STANDING_REFUSALS)


class HeartbeatOut(BaseModel):
    model_config = _OUT

    deadline: datetime


class ProgressIn(BaseModel):
    model_config = _IN

    step: int = Field(ge=0, le=10_000, description="index of the concurrency level just measured")
    concurrency: int = Field(ge=1, le=4096)
    output_tok_s: TokS
    accept_length: float | None = Field(default=None, ge=0, le=10_000)
    phase: Word | None = None  # the lease kind; a word, so it cannot forge a log line


class ProgressOut(BaseModel):
    model_config = _OUT

    action: Literal["continue", "prune"]


class LevelMetrics(BaseModel):
    """Measurements at one concurrency level (aggregated over the workload's repeats)."""

    model_config = _IN

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

    model_config = _IN

    concurrency: int = Field(ge=1, le=4096)
    tokens: int = Field(ge=1, le=4096)
    seconds: float = Field(ge=0, le=3600, description="median wall seconds of one such forward")
    seconds_runs: list[Annotated[float, Field(ge=0, le=3600)]] = Field(default_factory=list, max_length=100)


class VerifyProbe(BaseModel):
    """Extends of a cached prefix timed on the baseline server (workers/loadgen/probe.py): the
    verify cost's shape, measured without a restart.  `spent_s`: what the probe cost the lease."""

    model_config = _IN

    points: list[VerifyProbePoint] = Field(default_factory=list, max_length=1024)
    prefix_tokens: int = Field(ge=0, le=1_000_000)
    cached_share: float | None = Field(default=None, ge=0, le=1)
    spent_s: float = Field(ge=0, le=1e7)
    note: str | None = Field(default=None, max_length=500)


class Metrics(BaseModel):
    model_config = _IN

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
    model_config = _IN

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


class CompleteIn(BaseModel):
    model_config = _IN

    outcome: Literal["ok", "failed"]
    metrics: Metrics | None = None
    failure: Failure | None = None


class CompleteOut(BaseModel):
    model_config = _OUT

    lease_id: Plain = Field(max_length=64)  # an echo of the request's id, never used in a path
    state: Word
    speedup: float | None = Field(default=None, ge=0, le=1e12)
    duplicate: bool = False
