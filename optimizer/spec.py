"""The study spec: the JSON/YAML contract a user writes to start a study (docs/design.md, "The study").

Field names here are the public contract.  `StudySpec.model_validate(...)` checks types and
ranges; `validate_spec()` adds SGLang's cross-field rules and raises `SpecError` naming the field.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from optimizer.errors import SpecError
from optimizer.space import SearchSpace, SpecConfig
from spectune_protocol.fields import LABEL_KEY_RE as LABEL_KEY_RE
from spectune_protocol.fields import LABEL_VALUE_RE as LABEL_VALUE_RE
from spectune_protocol.fields import MODEL_NAME_RE as MODEL_NAME_RE
from spectune_protocol.fields import NAME_RE as NAME_RE
from spectune_protocol.workload import MAX_CONCURRENCY_LEVELS as MAX_CONCURRENCY_LEVELS
from spectune_protocol.workload import Workload as Workload

# Seeds Optuna's samplers (numpy) accept; optimizer.study derives per-ask seeds from it modulo 2**32.
MAX_SEED = 2**32 - 1
# Budgets must stay within what datetime arithmetic handles (timedelta overflows near 2.7e10 h);
# 100,000 hours is about 11 years, longer than any study.
MAX_HOURS = 100_000.0
MAX_PATIENCE = 10_000
# Numeric extra_args values: within what SGLang's int/float flags can hold.
MAX_INT_ARG = 2**31 - 1
MAX_FLOAT_ARG = 1e9
# The largest search space a study may have: the model sampler and the finishing rule build every
# configuration of it (about 0.5 kB and 10 us each), so a space of 2e8 cost 5 GB and a minute of
# CPU on every report.  The API may lower or raise it (SPECTUNE_MAX_SPACE_CONFIGS).
MAX_SPACE_CONFIGS = 100_000
# A grid enqueues every configuration as an Optuna trial at creation; more than a budget can ever
# measure (max_trials <= 10,000) is never useful.
MAX_GRID_CONFIGS = 10_000
# A lease holds a GPU host for its whole benchmark, and heartbeats keep it alive while the worker
# runs, so the workload itself must end: a level (its warm-up and every pass) may be expected to
# take at most this long.  Four hours is far past any useful measurement (the default workload's
# level takes about a minute on an H100) and still returns a host within one working shift.
MAX_LEVEL_S = 4 * 3600.0
# The per-request decode rate a level's duration is estimated with: a floor below the slowest
# baseline in docs/calibration.md (a large MoE at TP8 over PCIe, 90 tok/s at batch 1), with room
# for the per-request slowdown of larger batches.
FLOOR_TOK_S_PER_REQUEST = 20.0

# Every string and list a spec holds is bounded (tests/optimizer/test_spec_bounds.py walks the JSON schema):
# each is stored, sent to workers and shown, so its size is fixed here, not by the request body.
# The lengths match the patterns that check them below.
_LabelKey = Annotated[str, StringConstraints(max_length=63)]
_LabelValue = Annotated[str, StringConstraints(max_length=128)]
_FlagName = Annotated[str, StringConstraints(max_length=64)]
_FlagWord = Annotated[str, StringConstraints(max_length=64)]

# Attention backends SGLang 0.5.23 accepts for `--attention-backend` that matter on GPU hosts.
ATTENTION_BACKENDS = ("fa3", "flashinfer", "triton", "trtllm_mha", "flashmla", "cutlass_mla", "fa4", "torch_native")
# Backends that accept topk > 1 with page size > 1 (docs/sglang.md §2 rule 5).
TREE_PAGED_BACKENDS = ("flashinfer", "fa3", "triton")

# Extra server flags a study may set: they shape the server but cannot run code or read files
# chosen by the API.  Value None means a boolean switch.
EXTRA_ARG_ALLOWLIST: dict[str, type | None] = {
    "--dtype": str,
    "--kv-cache-dtype": str,
    "--quantization": str,
    "--chunked-prefill-size": int,
    "--max-prefill-tokens": int,
    "--schedule-conservativeness": float,
    "--ep-size": int,
    "--dp-size": int,
    "--moe-runner-backend": str,
    "--disable-radix-cache": None,
    "--enable-dp-attention": None,
    "--trust-remote-code": None,
    "--disable-overlap-schedule": None,
}
# A word value starts with a letter or digit: "--host" or "-x" would read as an option to argparse.
_SAFE_VALUE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,63}\Z")

# Every spec model refuses NaN and +-Infinity (JSON `NaN`, `Infinity`, and `1e309`, which Python
# reads as infinity): they would be stored, then sent to workers as null, or break arithmetic.
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class ModelSection(BaseModel):
    model_config = _STRICT

    target: str = Field(max_length=128)
    draft: str = Field(max_length=128)
    algorithm: Literal["EAGLE3"] = "EAGLE3"
    tp_size: int = Field(default=1, ge=1, le=64)
    attention_backend: str = Field(default="fa3", max_length=32)
    page_size: int = Field(default=1, ge=1, le=1024)
    mem_fraction_static: float | None = Field(default=None, gt=0.0, lt=1.0)
    context_length: int | None = Field(default=None, ge=128, le=10_000_000)
    # NaN and Infinity pass the type here only so that `_extra` refuses them naming the flag.
    extra_args: dict[_FlagName, _FlagWord | int | Annotated[float, AllowInfNan(True)] | bool] = Field(
        default_factory=dict, max_length=len(EXTRA_ARG_ALLOWLIST)
    )

    @field_validator("target", "draft")
    @classmethod
    def _model_name(cls, v: str) -> str:
        # Names, not paths: workers resolve them through their own registry.
        if not MODEL_NAME_RE.match(v) or ".." in v or v.startswith("/"):
            raise ValueError(
                f"{v!r} is not a model name; use a registry name such as 'llama-3.1-8b' "
                "(letters, digits, . _ / -), never a filesystem path"
            )
        return v

    @field_validator("attention_backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        if v not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {v!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
        return v

    @field_validator("extra_args")
    @classmethod
    def _extra(cls, v: dict[str, str | int | float | bool]) -> dict[str, str | int | float | bool]:
        for flag, value in v.items():
            if flag not in EXTRA_ARG_ALLOWLIST:
                raise ValueError(
                    f"flag {flag!r} is not allowed; allowed extra flags: {', '.join(sorted(EXTRA_ARG_ALLOWLIST))}"
                )
            kind = EXTRA_ARG_ALLOWLIST[flag]
            if kind is None:
                if value is not True and value is not False:
                    raise ValueError(f"{flag} is a switch: give true or false")
            elif kind is int:
                if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_INT_ARG:
                    raise ValueError(f"{flag} takes an integer between -{MAX_INT_ARG} and {MAX_INT_ARG}")
            elif kind is float:
                if (
                    isinstance(value, bool)
                    or not isinstance(value, int | float)
                    or not math.isfinite(value)
                    or abs(value) > MAX_FLOAT_ARG
                ):
                    raise ValueError(f"{flag} takes a finite number between -{MAX_FLOAT_ARG:g} and {MAX_FLOAT_ARG:g}")
            elif not isinstance(value, str) or not _SAFE_VALUE_RE.match(value):
                raise ValueError(
                    f"{flag} takes a short word (letters, digits, . _ : + -) starting with a letter or digit, "
                    f"got {str(value)[:70]!r}"
                )
        return v


def describe_workload(w: Workload) -> str:
    """The workload measured, in one line (the study document, `show` and the report state it)."""
    if w.output_len_source == "uniform":
        out = f"output {w.output_len_min}-{w.output_len} tokens (uniform)"
    elif w.output_len_source == "dataset":
        out = f"output lengths from the dataset ({w.output_len} where it records none)"
    else:
        out = f"output {w.output_len} tokens"
    if w.input_len is None:
        inp = "inputs as written"
    elif w.input_len_min is None:
        inp = f"inputs ~{w.input_len} tokens"
    else:
        inp = f"inputs ~{w.input_len_min}-{w.input_len} tokens (uniform)"
    levels = ", ".join(str(c) for c in w.concurrency)
    if w.request_rate is None:
        load = f"closed loop at concurrency {levels}"
    else:
        load = (
            f"open loop: Poisson arrivals at {w.request_rate:g} req/s, at most {levels} in flight "
            "(output tok/s equals the rate wherever the server keeps up; per-user tok/s and latencies show the rest)"
        )
    return f"{w.prompts}; {inp}; {out}; {load}; {w.num_prompts} requests x {w.repeats} passes"


# What a server is judged by (optimizer/objective.py computes each as a ratio over the same host's
# baseline, > 1 better): output tok/s of all requests together, the per-user decode rate, TTFT or
# inter-token latency at a percentile (baseline / trial), or goodput: the requests (or their
# tokens) per second that meet the p99 TTFT / ITL limits.  "speedup" is the old name of
# "throughput".  None: "throughput" for a closed-loop workload, "per_user" for an open-loop one
# (below saturation its output tok/s is the arrival rate whatever the configuration).
MetricName = Literal["throughput", "per_user", "ttft", "itl", "goodput"]
OPEN_LOOP_METRIC: MetricName = "per_user"


class Objective(BaseModel):
    model_config = _STRICT

    metric: Literal["throughput", "per_user", "ttft", "itl", "goodput", "speedup"] | None = None
    # The percentile a "ttft" or "itl" objective compares.
    percentile: Literal[50, 90, 99] = 99
    # What "goodput" counts: requests/s or output tok/s of the requests meeting the limits.
    goodput_unit: Literal["req_s", "tok_s"] = "req_s"
    # One level, or None: geometric mean of the speedups over all levels.
    concurrency: int | None = None
    # Optional limits; a trial over one is told to Optuna as a violated constraint.  Finite, and
    # at most a day: a violation is computed from them.
    max_p99_itl_ms: float | None = Field(default=None, gt=0, le=86_400_000)
    max_p99_ttft_ms: float | None = Field(default=None, gt=0, le=86_400_000)

    @property
    def name(self) -> MetricName:
        """The metric, once the study resolved the default (`StudySpec`): "speedup" reads "throughput"."""
        if self.metric is None or self.metric == "speedup":
            return "throughput"
        return self.metric

    @model_validator(mode="after")
    def _goodput_needs_limits(self) -> Objective:
        if self.metric == "goodput" and self.max_p99_ttft_ms is None and self.max_p99_itl_ms is None:
            raise ValueError(
                "metric 'goodput' counts the requests meeting the SLO: set max_p99_ttft_ms and/or max_p99_itl_ms"
            )
        return self


class Budget(BaseModel):
    model_config = _STRICT

    max_trials: int = Field(default=30, ge=1, le=10_000)
    max_hours: float | None = Field(default=None, gt=0, le=MAX_HOURS)
    patience: int | None = Field(default=None, ge=1, le=MAX_PATIENCE)
    # Convergence stop (optimizer.convergence): finish once no configuration left is likely to
    # beat the incumbent by more than this share; max_trials / max_hours stay caps.
    converge: bool = True
    min_gain: float = Field(default=0.01, ge=0.0, le=1.0)


# `list`: a benchmark of the `warm_start` configurations only (bench_speculative's standalone use).
SamplerName = Literal["auto", "tpe", "gp", "random", "grid", "list"]


class Confirmation(BaseModel):
    """Re-measure the best candidates next to a fresh baseline before the study finishes."""

    model_config = _STRICT

    # How many of the best distinct configurations to re-measure; 0 skips confirmation.
    top: int = Field(default=3, ge=0, le=10)


class Serving(BaseModel):
    """The load the tuned server will serve in production: the exported launch command is sized by it.

    Without this section the exported command caps nothing below SGLang's own defaults (with
    speculation SGLang serves at most 48 requests and captures graphs up to that; docs/sglang.md).
    """

    model_config = _STRICT

    # `--max-running-requests` of the deployed server; the trials run with it too, so the KV pool
    # (and any out-of-memory) is the one production sees.
    max_running_requests: int = Field(ge=1, le=100_000)
    # Largest batch captured in CUDA graphs (`--cuda-graph-max-bs[-decode]`); default: max_running_requests.
    max_batch: int | None = Field(default=None, ge=1, le=4096)


class StudySpec(BaseModel):
    model_config = _STRICT

    name: str = Field(max_length=63)
    model: ModelSection
    search_space: SearchSpace = Field(default_factory=SearchSpace)
    workload: Workload = Field(default_factory=Workload)
    objective: Objective = Field(default_factory=Objective)
    budget: Budget = Field(default_factory=Budget)
    # `auto`: the model-based sampler (optimizer.model_sampler); benchmarks/README.md shows it
    # needs far fewer restarts than TPE, random search or SGLang's grid.
    sampler: SamplerName = "auto"
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    # Labels a worker must carry; a worker reports at most 64 (spectune_protocol.Inventory).
    placement: dict[_LabelKey, _LabelValue] = Field(default_factory=dict, max_length=64)
    # Configurations to try first, in addition to SGLang's defaults when they fit the space.  Each
    # is enqueued as an Optuna trial at creation, as a grid's are, so the grid's cap holds (11,000
    # took two minutes to create and slowed every lease and report of every study).
    warm_start: list[SpecConfig] = Field(default_factory=list, max_length=MAX_GRID_CONFIGS)
    confirmation: Confirmation = Field(default_factory=Confirmation)
    # The production envelope of the exported launch command (None: SGLang's own defaults).
    serving: Serving | None = None

    @model_validator(mode="after")
    def _default_metric(self) -> StudySpec:
        # Resolved once, when the spec is first read, and stored so: the study keeps its objective.
        if self.objective.metric is None:
            metric: MetricName = "throughput" if self.workload.request_rate is None else OPEN_LOOP_METRIC
            self.objective = self.objective.model_copy(update={"metric": metric})
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(
                f"{v!r} is not a valid study name: use 1-63 lowercase letters, digits, '-' or '_', "
                "starting with a letter or digit"
            )
        return v

    @field_validator("placement")
    @classmethod
    def _placement(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not LABEL_KEY_RE.match(key):
                raise ValueError(f"placement label {key[:70]!r}: keys are 1-63 letters, digits, '.', '_', '/' or '-'")
            if not LABEL_VALUE_RE.match(value):
                raise ValueError(f"placement label {key!r}: values are at most 128 characters, no control characters")
        return v


def level_seconds(w: Workload, concurrency: int) -> tuple[float, float]:
    """A level's expected duration, split into (open-loop arrivals, decoding), in seconds.

    Arrivals: each pass spreads `num_prompts` requests over `num_prompts / request_rate` seconds
    whatever the server does.  Decoding: the warm-up and every pass's requests, `concurrency` at a
    time, each `output_len` tokens at FLOOR_TOK_S_PER_REQUEST.  A level takes at least the larger.
    """
    arrivals = 0.0 if w.request_rate is None else w.repeats * w.num_prompts / w.request_rate
    requests = w.warmup_requests + w.repeats * w.num_prompts
    decoding = math.ceil(requests / concurrency) * w.output_len / FLOOR_TOK_S_PER_REQUEST
    return arrivals, decoding


def check_level_durations(w: Workload) -> None:
    """Refuse a workload whose levels could hold a host longer than MAX_LEVEL_S (SpecError)."""
    for c in w.concurrency:
        arrivals, decoding = level_seconds(w, c)
        if arrivals > MAX_LEVEL_S:
            # request_rate >= repeats * num_prompts / MAX_LEVEL_S keeps the arrivals in bounds.
            least = w.repeats * w.num_prompts / MAX_LEVEL_S
            raise SpecError(
                "workload.request_rate",
                f"{w.request_rate:g} req/s spreads each level's {w.repeats} x {w.num_prompts} requests over "
                f"{arrivals:,.0f} s, above the limit of {MAX_LEVEL_S:,.0f} s a level may hold a host: raise "
                f"request_rate to at least {least:.3g} req/s, or lower num_prompts or repeats",
            )
        if decoding > MAX_LEVEL_S:
            raise SpecError(
                "workload",
                f"at concurrency {c} a level decodes {w.warmup_requests} + {w.repeats} x {w.num_prompts} requests "
                f"of {w.output_len} tokens, about {decoding:,.0f} s at {FLOOR_TOK_S_PER_REQUEST:g} tok/s per "
                f"request, above the limit of {MAX_LEVEL_S:,.0f} s a level may hold a host: lower num_prompts, "
                "repeats, warmup_requests or output_len, or drop that concurrency level",
            )


def validate_spec(spec: StudySpec, max_configs: int = MAX_SPACE_CONFIGS) -> StudySpec:
    """Cross-field checks that pydantic alone cannot express.  Raises SpecError."""
    spec.search_space.validate_rules()
    check_level_durations(spec.workload)
    count = spec.search_space.count_configs()
    if count > max_configs:
        raise SpecError(
            "search_space",
            f"the space holds {count:,} configurations, above the limit of {max_configs:,}: narrow num_steps, "
            "topk, num_draft_tokens or cuda_graph_max_bs (a study measures tens of them; the tuner must score "
            "every one on each ask)",
        )
    if spec.sampler == "grid" and count > MAX_GRID_CONFIGS:
        raise SpecError(
            "sampler",
            f"a grid measures every configuration, and this space holds {count:,} (at most {MAX_GRID_CONFIGS:,} "
            "for a grid): narrow the space or use sampler 'auto'",
        )
    tree = any(t > 1 for t in spec.search_space.topk)
    backend = spec.model.attention_backend
    if backend == "trtllm_mha" and tree:
        raise SpecError("search_space.topk", "the trtllm_mha attention backend allows only topk 1; use topk: [1]")
    if tree and spec.model.page_size > 1 and backend not in TREE_PAGED_BACKENDS:
        raise SpecError(
            "model.attention_backend",
            f"topk > 1 with page_size {spec.model.page_size} needs one of {', '.join(TREE_PAGED_BACKENDS)}",
        )
    levels = spec.workload.concurrency
    if spec.objective.concurrency is not None and spec.objective.concurrency not in levels:
        raise SpecError(
            "objective.concurrency",
            f"{spec.objective.concurrency} is not one of the workload's concurrency levels {levels}",
        )
    if spec.workload.request_rate is not None and spec.objective.name == "throughput":
        raise SpecError(
            "objective.metric",
            f"an open-loop workload (request_rate {spec.workload.request_rate:g} req/s) serves its arrival rate: "
            "below saturation its output tok/s equals the rate times the output length whatever the configuration, "
            "so a throughput speedup cannot move; use metric 'per_user' (the default here: each user's tok/s), "
            "'itl' or 'ttft', or 'goodput' with max_p99_ttft_ms / max_p99_itl_ms",
        )
    if spec.search_space.cuda_graph_max_bs is not None:
        if max(spec.search_space.cuda_graph_max_bs) < 1:
            raise SpecError("search_space.cuda_graph_max_bs", "must be positive")
    if spec.serving is not None:
        top = max(levels)
        if spec.serving.max_running_requests < top:
            raise SpecError(
                "serving.max_running_requests",
                f"{spec.serving.max_running_requests} is below the workload's largest concurrency {top}: "
                f"the server could not run the benchmark; raise it to at least {top} or drop that level",
            )
        mb = spec.serving.max_batch
        if mb is not None and mb > spec.serving.max_running_requests:
            raise SpecError(
                "serving.max_batch",
                f"{mb} is above max_running_requests {spec.serving.max_running_requests}: SGLang never runs a "
                "larger batch, so those graphs would never be used; leave max_batch out or lower it",
            )
    if spec.sampler == "list":
        n = len({c.canonical().key for c in spec.warm_start})
        if n == 0:
            raise SpecError("warm_start", "sampler 'list' measures the warm_start configurations: list at least one")
        if spec.budget.max_trials != n:
            raise SpecError(
                "budget.max_trials",
                f"sampler 'list' measures exactly the {n} distinct warm_start configurations: set max_trials to {n}",
            )
    for i, cfg in enumerate(spec.warm_start):
        field = f"warm_start.{i}"
        try:
            canon = cfg.check()
        except SpecError as e:
            raise SpecError(f"{field}.{e.field}", e.message) from e
        if canon.dominated:
            raise SpecError(
                field,
                f"{canon.key} has more steps than its draft tokens can use (steps > draft tokens - 1 with "
                f"topk > 1): the same tree with steps {canon.num_draft_tokens - 1} is faster",
            )
        if not spec.search_space.contains(canon):
            raise SpecError(field, f"{canon.key} lies outside the search space")
    return spec


def parse_spec(data: object) -> StudySpec:
    """Validate raw JSON/YAML data into a spec.  Raises pydantic.ValidationError or SpecError."""
    return validate_spec(StudySpec.model_validate(data))
