"""SGLang's command line, per version: typed server settings in, an argv list out.

Facts from docs/sglang.md §1-3 (checked against the 0.5.x wheels):

| version        | max captured batch            | explicit capture list    |
|----------------|-------------------------------|--------------------------|
| < 0.5.16       | --cuda-graph-max-bs           | --cuda-graph-bs          |
| 0.5.16-0.5.19  | --cuda-graph-max-bs-decode    | --cuda-graph-bs-decode   |  (old names deprecated aliases)
| >= 0.5.20      | --cuda-graph-max-bs-decode    | --cuda-graph-bs-decode   |  (old names are ambiguous
|                |                               |                          |   prefixes: argparse exit 2)

Nothing here runs a process; the worker's launcher does that with the list this module builds.
The API uses the same code to print the exact launch command of a result.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from optimizer.space import MAX_STEPS, SpecConfig

# Every field is bounded as the study spec bounds it (optimizer.spec): these settings travel to
# workers, which must not trust the API (SECURITY.md), so a lease cannot carry a value that no
# spec could have produced, nor text that could forge a log line.  Names and words are only
# held to "plain text" here: the worker refuses paths, unknown models and option-like words itself,
# with a message that names the problem (workers/agent.py: server_settings_refusal).
# Patterns run in pydantic-core, where `$` is the end of the text.
_Text = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x1f\x7f]{1,256}$")]
_FlagName = Annotated[str, StringConstraints(pattern=r"^--[a-z0-9][a-z0-9-]{0,62}$")]
_GraphBs = Annotated[int, Field(ge=1, le=4096)]


class FlagSet(StrEnum):
    """The three generations of CUDA-graph flag names."""

    LEGACY = "legacy"  # <= 0.5.13 (and anything before 0.5.16)
    V0516 = "0.5.16"  # 0.5.16 .. 0.5.19: new names, old ones kept as aliases
    MODERN = "0.5.20"  # >= 0.5.20: new names only


_VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)")


def parse_version(version: str) -> tuple[int, int, int]:
    m = _VERSION_RE.match(version.strip().lstrip("v"))
    if not m:
        raise ValueError(f"cannot read an SGLang version from {version!r}; expected e.g. '0.5.23'")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def flag_set_for(version: str) -> FlagSet:
    v = parse_version(version)
    if v < (0, 5, 16):
        return FlagSet.LEGACY
    if v < (0, 5, 20):
        return FlagSet.V0516
    return FlagSet.MODERN


# SGLang's adaptive speculative mode (`--speculative-adaptive --speculative-adaptive-config FILE`),
# read from the 0.5.13, 0.5.16 and 0.5.23 wheels (`speculative/adaptive_spec_params.py`,
# `arg_groups/speculative_hook.py`; absent from 0.5.10).  The file is a JSON object whose
# integer-string keys are batch sizes, each with `candidate_steps`: non-negative integers from
# 0.5.16 on (0 = no drafting at that batch size), positive ones only in 0.5.13.  A running batch is
# padded to its CUDA-graph size and served by the largest key not above it (the smallest key when
# it is below all of them).  Adaptive mode runs chains only (topk 1, draft tokens = steps + 1), and
# `--speculative-num-steps` must be one of the candidate steps.
ADAPTIVE_SINCE = (0, 5, 13)
ADAPTIVE_STEPS_OFF_SINCE = (0, 5, 16)
MAX_ADAPTIVE_SLOTS = 64


class AdaptiveSteps(BaseModel):
    """An adaptive deployment as typed data: the steps SGLang runs at each batch size.

    One candidate per batch size (what a study measured there), so the server never switches
    between candidates at run time.  It travels in a lease as numbers only; the worker writes
    SGLang's JSON file from it itself (`config_doc`), never text or a path from the API.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps_by_batch: dict[_GraphBs, Annotated[int, Field(strict=True, ge=0, le=MAX_STEPS)]] = Field(
        min_length=1, max_length=MAX_ADAPTIVE_SLOTS
    )

    @model_validator(mode="after")
    def _some_slot_speculates(self) -> AdaptiveSteps:
        if not any(self.steps_by_batch.values()):
            raise ValueError("an adaptive config with steps 0 at every batch size is a server without speculation")
        return self

    def config_doc(self) -> dict[str, dict[str, list[int]]]:
        """SGLang's config file content, batch sizes in numeric order."""
        return {str(bs): {"candidate_steps": [self.steps_by_batch[bs]]} for bs in sorted(self.steps_by_batch)}

    def config_text(self) -> str:
        return json.dumps(self.config_doc())

    def steps_at(self, batch: int) -> int:
        """The steps SGLang's slot routing gives a (padded) batch of this size."""
        keys = sorted(self.steps_by_batch)
        below = [k for k in keys if k <= batch]
        return self.steps_by_batch[below[-1] if below else keys[0]]

    @classmethod
    def from_config(cls, doc: Mapping[str, Any]) -> AdaptiveSteps:
        """From a config of single-candidate slots (optimizer.answer.adaptive_export)."""
        return cls(steps_by_batch={int(k): int(v["candidate_steps"][0]) for k, v in doc.items() if k.isdigit()})


def adaptive_refusal(version: str, adaptive: AdaptiveSteps) -> str | None:
    """Why SGLang `version` cannot run this adaptive config as written, or None."""
    v = parse_version(version)
    if v < ADAPTIVE_SINCE:
        return (
            f"SGLang {version} has no --speculative-adaptive (it came with 0.5.13): "
            "upgrade SGLang on this host to run an adaptive deployment"
        )
    if v < ADAPTIVE_STEPS_OFF_SINCE and 0 in adaptive.steps_by_batch.values():
        return (
            f"SGLang {version} accepts only positive candidate steps in --speculative-adaptive-config; steps 0 "
            "(speculation off at a batch size) came with 0.5.16: upgrade SGLang on this host"
        )
    return None


class ServerSettings(BaseModel):
    """Everything that decides how one SGLang server is launched, as typed values.

    `target` and `draft` are registry names; the worker maps them to local paths.  `speculative`
    is None for a baseline (the same server without speculation).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    target: _Text
    draft: _Text | None = None
    algorithm: Literal["EAGLE3"] = "EAGLE3"
    tp_size: int = Field(default=1, ge=1, le=64)
    attention_backend: _Text = "fa3"
    page_size: int = Field(default=1, ge=1, le=1024)
    mem_fraction_static: float | None = Field(default=None, gt=0.0, lt=1.0)
    context_length: int | None = Field(default=None, ge=128, le=10_000_000)
    # Always passed: with speculation on and the flag absent SGLang silently caps it at 48.
    max_running_requests: int = Field(ge=1, le=100_000)
    # Largest captured decode batch; or an explicit capture list (it wins when both are set).
    cuda_graph_max_bs: _GraphBs | None = None
    cuda_graph_bs: tuple[_GraphBs, ...] | None = Field(default=None, max_length=64)
    speculative: SpecConfig | None = None
    extra_args: dict[_FlagName, _Text | int | float | bool] = Field(default_factory=dict, max_length=32)
    # SGLang's adaptive mode (None: static speculation).  Left out of the serialised form when
    # None, so every stored key and lease of a static server is what it was before the field.
    # (exclude_if rather than a wrapping serializer: that one erased the field types from OpenAPI.)
    adaptive: AdaptiveSteps | None = Field(default=None, exclude_if=lambda v: v is None)

    @model_validator(mode="after")
    def _adaptive_is_a_chain(self) -> ServerSettings:
        if self.adaptive is None:
            return self
        spec = self.speculative
        if spec is None or spec.topk != 1:
            raise ValueError("an adaptive server needs speculation with topk 1 (SGLang's adaptive mode runs chains)")
        if spec.num_steps not in set(self.adaptive.steps_by_batch.values()):
            raise ValueError(
                f"speculative num_steps {spec.num_steps} must be one of the adaptive config's steps "
                f"{sorted(set(self.adaptive.steps_by_batch.values()))} (SGLang refuses to start otherwise)"
            )
        return self

    def baseline(self) -> ServerSettings:
        """The same server without speculation: the reference every speedup is measured against."""
        return self.model_copy(update={"speculative": None, "draft": None, "adaptive": None})


def build_server_args(
    settings: ServerSettings,
    *,
    version: str,
    model_path: str,
    draft_model_path: str | None,
    host: str = "127.0.0.1",
    port: int = 30000,
    adaptive_config_path: str | None = None,
) -> list[str]:
    """The argument list after `python -m sglang.launch_server` for this SGLang version.

    An adaptive server needs `adaptive_config_path`, where its caller wrote
    `settings.adaptive.config_text()` (the worker: its own run directory; the printed command: a
    file the user writes first).
    """
    flags = flag_set_for(version)
    args = [
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(settings.tp_size),
        "--attention-backend", settings.attention_backend,
        "--page-size", str(settings.page_size),
        "--max-running-requests", str(settings.max_running_requests),
        "--enable-metrics",
    ]  # fmt: skip
    if settings.mem_fraction_static is not None:
        args += ["--mem-fraction-static", repr(settings.mem_fraction_static)]
    if settings.context_length is not None:
        args += ["--context-length", str(settings.context_length)]
    max_bs_flag, bs_list_flag = (
        ("--cuda-graph-max-bs", "--cuda-graph-bs")
        if flags is FlagSet.LEGACY
        else ("--cuda-graph-max-bs-decode", "--cuda-graph-bs-decode")
    )
    if settings.cuda_graph_bs:
        args += [bs_list_flag, *(str(b) for b in settings.cuda_graph_bs)]
    elif settings.cuda_graph_max_bs is not None:
        args += [max_bs_flag, str(settings.cuda_graph_max_bs)]
    spec = settings.speculative
    if spec is not None:
        if draft_model_path is None:
            raise ValueError("a speculative server needs the draft model's path")
        c = spec.canonical()
        args += [
            "--speculative-algorithm", settings.algorithm,
            "--speculative-draft-model-path", draft_model_path,
            "--speculative-num-steps", str(c.num_steps),
            "--speculative-eagle-topk", str(c.topk),
            "--speculative-num-draft-tokens", str(c.num_draft_tokens),
        ]  # fmt: skip
    if settings.adaptive is not None:
        problem = adaptive_refusal(version, settings.adaptive)
        if problem is not None:
            raise ValueError(problem)
        if adaptive_config_path is None:
            raise ValueError("an adaptive server needs the path of its adaptive config file")
        args += ["--speculative-adaptive", "--speculative-adaptive-config", adaptive_config_path]
    for flag, value in sorted(settings.extra_args.items()):
        if value is True:
            args.append(flag)
        elif value is False:
            continue
        else:
            args += [flag, str(value)]
    return args


def launch_command(
    settings: ServerSettings,
    *,
    version: str = "0.5.23",
    model_path: str | None = None,
    draft_model_path: str | None = None,
    port: int = 30000,
    host: str = "127.0.0.1",
    pin_max_running_requests: bool = True,
    adaptive_config_path: str | None = None,
) -> str:
    """A copy-pasteable shell line for humans (never executed by spectune).

    `host` defaults to loopback: a server that should answer other machines is a deliberate choice
    (`spectune study best --host`).  `pin_max_running_requests=False` leaves the cap to SGLang
    (a server without speculation has no 48 cap; docs/sglang.md "Resolution rules").
    """
    args = build_server_args(
        settings,
        version=version,
        model_path=model_path or settings.target,
        draft_model_path=draft_model_path or settings.draft or "DRAFT_MODEL",
        host=host,
        port=port,
        adaptive_config_path=adaptive_config_path,
    )
    if not pin_max_running_requests:
        i = args.index("--max-running-requests")
        del args[i : i + 2]
    return shlex.join(["python", "-m", "sglang.launch_server", *args])
