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

import re
import shlex
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from optimizer.space import SpecConfig

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

    def baseline(self) -> ServerSettings:
        """The same server without speculation: the reference every speedup is measured against."""
        return self.model_copy(update={"speculative": None, "draft": None})


def build_server_args(
    settings: ServerSettings,
    *,
    version: str,
    model_path: str,
    draft_model_path: str | None,
    host: str = "127.0.0.1",
    port: int = 30000,
) -> list[str]:
    """The argument list after `python -m sglang.launch_server` for this SGLang version."""
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
    extra: Sequence[str] = (),
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
    )
    if not pin_max_running_requests:
        i = args.index("--max-running-requests")
        del args[i : i + 2]
    return shlex.join(["python", "-m", "sglang.launch_server", *args, *extra])
