"""The wire contract between workers and the API (lease protocol, docs/design.md "Leases").

A package of its own, imported by both sides: the API (`api/`) and the worker (`workers/`), so a
GPU host's worker-only install (the wheel with its `sglang` extra) needs neither the web framework
nor Optuna.  It imports the standard library and pydantic only (tests/support/test_import_cycles.py
checks it): the server settings, configurations and workloads a lease carries are defined here,
and `optimizer` imports them from here.

    fields       names, versions, plain text and number bounds every model below uses
    errors       SpecError, raised by a configuration's own rules
    speculative  SpecConfig: one EAGLE-3 configuration, with SGLang's resolution rules
    server       ServerSettings, AdaptiveSteps: how one SGLang server is launched
    workload     Workload: the requests measured at each concurrency level
    inventory    what a worker says about its host (GpuInfo, Inventory)
    leases       LeaseKind, LeaseState, LeaseOut and the calls a worker makes while it holds one
    reports      what a worker reports (LevelMetrics, Metrics, Failure)
    standing     what the fleet decided about a worker (the lease answers' header)
    printable    text that crossed the wire, made safe to print on one line
"""

from __future__ import annotations

from spectune_protocol.errors import (
    SpecError,
)
from spectune_protocol.fields import (
    LABEL_KEY_RE,
    LABEL_VALUE_RE,
    MAX_COUNT,
    MAX_EFFECTIVE_DEPTH,
    MAX_HEARTBEAT_S,
    MAX_LABELS,
    MAX_MODELS,
    MAX_MS,
    MAX_RESOLVE_THRESHOLD,
    MAX_TOK_S,
    MIN_HEARTBEAT_S,
    MIN_TOK_S,
    MODEL_NAME_RE,
    NAME_RE,
    VERSION_PATTERN,
    Count,
    LabelKey,
    LabelValue,
    LeaseId,
    Millis,
    ModelName,
    Plain,
    PromptFile,
    StudyName,
    TokS,
    Version,
    Word,
)
from spectune_protocol.inventory import (
    GpuInfo,
    Inventory,
)
from spectune_protocol.leases import (
    CompleteIn,
    CompleteOut,
    HeartbeatOut,
    LeaseKind,
    LeaseOut,
    LeaseState,
    ProgressIn,
    ProgressOut,
    Resolve,
    Slo,
)
from spectune_protocol.reports import (
    Failure,
    FailureKind,
    LevelMetrics,
    Metrics,
    RunKey,
    SpecField,
    VerifyProbe,
    VerifyProbePoint,
    json_problem,
)
from spectune_protocol.server import (
    MAX_ADAPTIVE_SLOTS,
    AdaptiveSteps,
    ServerSettings,
)
from spectune_protocol.speculative import (
    BOUND_TEXT,
    MAX_DRAFT_TOKENS,
    MAX_STEPS,
    MAX_TOPK,
    MIN_DRAFT_TOKENS,
    SpecConfig,
    max_draft_tokens,
)
from spectune_protocol.standing import (
    MAX_STANDING_REFUSALS,
    STANDING_HEADER,
    RefusedStudy,
    WorkerStanding,
)
from spectune_protocol.workload import (
    MAX_CONCURRENCY_LEVELS,
    Workload,
)

__all__ = [
    "AdaptiveSteps",
    "BOUND_TEXT",
    "CompleteIn",
    "CompleteOut",
    "Count",
    "Failure",
    "FailureKind",
    "GpuInfo",
    "HeartbeatOut",
    "Inventory",
    "LABEL_KEY_RE",
    "LABEL_VALUE_RE",
    "LabelKey",
    "LabelValue",
    "LeaseId",
    "LeaseKind",
    "LeaseOut",
    "LeaseState",
    "LevelMetrics",
    "MAX_ADAPTIVE_SLOTS",
    "MAX_CONCURRENCY_LEVELS",
    "MAX_COUNT",
    "MAX_DRAFT_TOKENS",
    "MAX_EFFECTIVE_DEPTH",
    "MAX_HEARTBEAT_S",
    "MAX_LABELS",
    "MAX_MODELS",
    "MAX_MS",
    "MAX_RESOLVE_THRESHOLD",
    "MAX_STANDING_REFUSALS",
    "MAX_STEPS",
    "MAX_TOK_S",
    "MAX_TOPK",
    "MIN_DRAFT_TOKENS",
    "MIN_HEARTBEAT_S",
    "MIN_TOK_S",
    "MODEL_NAME_RE",
    "Metrics",
    "Millis",
    "ModelName",
    "NAME_RE",
    "Plain",
    "ProgressIn",
    "ProgressOut",
    "PromptFile",
    "RefusedStudy",
    "Resolve",
    "RunKey",
    "STANDING_HEADER",
    "ServerSettings",
    "Slo",
    "SpecConfig",
    "SpecError",
    "SpecField",
    "VerifyProbe",
    "VerifyProbePoint",
    "StudyName",
    "TokS",
    "VERSION_PATTERN",
    "Version",
    "Word",
    "WorkerStanding",
    "Workload",
    "json_problem",
    "max_draft_tokens",
]
