"""Errors raised by the workers package.

    WorkerError
    ├── ConfigError          the worker's own configuration is wrong (config file, engine interpreter)
    ├── LaunchError          an SGLang server did not come up (kind: spectune_protocol.FailureKind)
    ├── LaunchCancelled      a launch was aborted on request; the server was stopped
    ├── GpuReleaseTimeout    stopped processes still hold GPU memory after the deadline
    └── ProcessSurvivedError processes of a stopped server outlived SIGKILL

`LaunchError.to_failure()` turns a launch failure into the wire model the worker reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from spectune_protocol import Failure, FailureKind

# Limits of spectune_protocol.Failure; the report must never be refused for being too long.
_MAX_MESSAGE = 4000
_MAX_LOG_TAIL = 20_000


class WorkerError(Exception):
    """Base of every error the workers package raises on purpose."""


class ConfigError(WorkerError):
    """The worker's configuration (or the engine interpreter it names) cannot be used as is."""


class LaunchError(WorkerError):
    """An SGLang server failed to start, or died.

    `kind` is what the lease report carries; `host_fault` says the host (its SGLang version,
    its port, its driver), not the configuration under trial, is to blame, so the API retries the
    trial elsewhere instead of teaching the sampler that the configuration is bad.
    """

    def __init__(self, kind: FailureKind, message: str, *, log_tail: str = "", host_fault: bool = False) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind: FailureKind = kind
        self.message = message
        self.log_tail = log_tail
        self.host_fault = host_fault

    def to_failure(self) -> Failure:
        message = self.message if len(self.message) <= _MAX_MESSAGE else self.message[: _MAX_MESSAGE - 3] + "..."
        # Keep the end of the log: the cause of a death is in its last lines.
        return Failure(
            kind=self.kind, message=message, log_tail=self.log_tail[-_MAX_LOG_TAIL:], host_fault=self.host_fault
        )


class LaunchCancelled(WorkerError):
    """The launch was cancelled (cancel event or a concurrent stop); nothing of it is left running."""


class GpuReleaseTimeout(WorkerError):
    """Processes of a stopped server still hold GPU memory after the release deadline."""

    def __init__(self, held_mib: Mapping[int, float | None], timeout_s: float, gpus: Sequence[int] = ()) -> None:
        parts = [
            f"pid {pid}: {'unknown' if mib is None else f'{mib:.0f}'} MiB" for pid, mib in sorted(held_mib.items())
        ]
        where = f" on GPU(s) {', '.join(map(str, gpus))}" if gpus else ""
        super().__init__(
            f"GPU memory not released {timeout_s:.0f} s after the server stopped{where}: "
            f"{'; '.join(parts)}. The driver frees memory asynchronously; if this persists, check "
            "`nvidia-smi` for those PIDs (a process stuck in the driver needs the host's attention) "
            "or raise timeouts.gpu_release_s in the worker config"
        )
        self.held_mib = dict(held_mib)
        self.timeout_s = timeout_s


class ProcessSurvivedError(WorkerError):
    """Processes of a stopped server are still alive after SIGKILL (stuck in the kernel, or escaped)."""

    def __init__(self, pgid: int, pids: Sequence[int]) -> None:
        super().__init__(
            f"processes {', '.join(map(str, sorted(pids)))} of server process group {pgid} survived SIGKILL; "
            "they are probably stuck in uninterruptible sleep (driver or filesystem): inspect them with "
            "`ps -o pid,stat,wchan -p <pid>` before starting another server on this GPU"
        )
        self.pgid = pgid
        self.pids = tuple(pids)
