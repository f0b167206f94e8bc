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
from enum import StrEnum

from spectune_protocol.server import MAX_ADAPTIVE_SLOTS as MAX_ADAPTIVE_SLOTS
from spectune_protocol.server import AdaptiveSteps as AdaptiveSteps
from spectune_protocol.server import ServerSettings as ServerSettings

# The settings themselves travel in leases, so they are the wire package's
# (spectune_protocol.server); the command line built from them is this module's.


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
