"""Why a server died, from its exit status and the tail of its log (docs/sglang.md §1, §2, §13).

Order matters: an argparse rejection (exit 2) is checked first, then out-of-memory (an OOM often
surfaces inside a later ValueError/RuntimeError traceback), then SGLang's start-up checks.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Collection

from spectune_protocol import FailureKind

# argparse prints "prog: error: <what>" and exits 2.  A flag this SGLang does not know (or an
# abbreviation that became ambiguous, as --cuda-graph-max-bs did in 0.5.20) is the host's version
# talking, not the configuration under trial.
_ARGPARSE_ERROR = re.compile(
    r"^.*\berror: (unrecognized arguments|ambiguous option|argument |the following arguments).*$", re.M
)
# "argument --dtype: invalid choice: 'bogus' (choose from ...)", "argument --tp-size: invalid int
# value: 'x'": argparse names the flag whose value it rejected.
_ARGPARSE_VALUE = re.compile(r"\berror: argument (--[A-Za-z0-9-]+)(?:/-\w+)?: (?:invalid|expected)")
_ARGPARSE_UNKNOWN = re.compile(r"\berror: unrecognized arguments: (.*)$", re.M)
_OOM = re.compile(
    r"^.*(CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|cudaErrorMemoryAllocation"
    r"|Not enough memory\. Please try to increase --mem-fraction-static).*$",
    re.M,
)
# SGLang validates resolved arguments with ValueError and assert at start-up (speculative_hook,
# attention backend checks): the configuration itself is not runnable.
_CONFIG_REJECTED = re.compile(r"^.*\b(ValueError|AssertionError)\b.*$", re.M)
# The last "SomethingError: message" line, to say something useful about an unclassified death.
_EXCEPTION_LINE = re.compile(r"^.*\b\w*(Error|Exception|Interrupt)\b:?.*$", re.M)

_MAX_DETAIL = 600


def _last(pattern: re.Pattern[str], text: str) -> str | None:
    found = None
    for m in pattern.finditer(text):
        found = m.group(0)
    return None if found is None else found.strip()[:_MAX_DETAIL]


def describe_returncode(returncode: int) -> str:
    """'exit code 1', 'signal SIGKILL', or 'exit code 137 (128+SIGKILL)' for a wrapper's status."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    if returncode > 128:
        try:
            return f"exit code {returncode} (128+{signal.Signals(returncode - 128).name})"
        except ValueError:
            pass
    return f"exit code {returncode}"


def _study_flag_fault(line: str, study_flags: Collection[str], how: str) -> tuple[FailureKind, bool, str] | None:
    """An argparse rejection of a flag the *study* chose (its `model.extra_args`): a study fault.

    A value SGLang rejects (`--dtype bogus`: invalid choice) is wrong wherever it runs: the
    configuration is invalid, never the host.  A study flag this SGLang does not know is this
    host's version declining what the study asks: `refused`, so the study goes elsewhere and the
    host is not charged.  (Seen: `--dtype bogus` quarantined a worker in under a second.)
    """
    value = _ARGPARSE_VALUE.search(line)
    if value is not None and value.group(1) in study_flags:
        return (
            "invalid_config",
            False,
            f"SGLang rejected the value the study gave {value.group(1)} ({how}): {line}. Fix the study's "
            "model.extra_args (see `python -m sglang.launch_server --help` for the accepted values)",
        )
    unknown = _ARGPARSE_UNKNOWN.search(line)
    if unknown is not None:
        named = {tok.split("=", 1)[0] for tok in unknown.group(1).split() if tok.startswith("--")}
        if named and named <= set(study_flags):
            return (
                "refused",
                False,
                f"this host's SGLang does not know the study's flag(s) {', '.join(sorted(named))} ({how}): {line}. "
                "Run the study on hosts whose SGLang has them, or remove them from model.extra_args",
            )
    return None


def classify_exit(returncode: int, log_tail: str, study_flags: Collection[str] = ()) -> tuple[FailureKind, bool, str]:
    """(kind, host_fault, message) for a server that exited with `returncode` before it was ready.

    `study_flags` are the flags the lease's study chose (`ServerSettings.extra_args`): argparse
    rejecting one of those is the study's fault, not the host's (`_study_flag_fault`).
    A server that dies after readiness is reported as `crash` by the caller whatever this says;
    the message is still the best description of the cause.
    """
    how = describe_returncode(returncode)
    if returncode == 2:
        line = _last(_ARGPARSE_ERROR, log_tail)
        if line is not None and (study := _study_flag_fault(line, study_flags, how)) is not None:
            return study
        if line is not None:
            return (
                "invalid_config",
                True,
                f"SGLang rejected its command line ({how}): {line}. The flag names do not match the SGLang "
                "version installed on this host: check the detected version (or the worker's sglang_version "
                "override) against `python -m sglang.launch_server --help`",
            )
    line = _last(_OOM, log_tail)
    if line is not None:
        return ("oom", False, f"out of GPU memory at start-up ({how}): {line}")
    line = _last(_CONFIG_REJECTED, log_tail)
    if line is not None:
        return ("invalid_config", False, f"SGLang refused the configuration at start-up ({how}): {line}")
    line = _last(_EXCEPTION_LINE, log_tail)
    if line is None:
        lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
        line = f"last log line: {lines[-1][:_MAX_DETAIL]}" if lines else None
    detail = f": {line}" if line else " (and left an empty log)"
    return ("crash", False, f"server exited with {how}{detail}")
