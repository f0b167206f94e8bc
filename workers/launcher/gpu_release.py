"""Waiting until the driver has freed the GPU memory of stopped processes (docs/sglang.md §10).

Reaped processes do not mean free memory: the driver releases it asynchronously.  We poll NVML's
per-GPU compute-process list until none of the old PIDs is listed, as SGLang's own test helpers do
(`wait_for_gpu_release`: every 0.5 s, with a deadline).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

from workers.errors import GpuReleaseTimeout, WorkerError
from workers.gpu import GpuProbe

logger = logging.getLogger("spectune.worker.launcher")

POLL_S = 0.5


def held_by(probe: GpuProbe, pids: Collection[int]) -> tuple[dict[int, float | None], list[int]]:
    """MiB each of `pids` still holds (summed over GPUs; None if unknown), and the GPUs involved."""
    held: dict[int, float | None] = {}
    gpus: set[int] = set()
    for p in probe.compute_processes():
        if p.pid in pids:
            gpus.add(p.gpu_index)
            before = held.get(p.pid, 0.0)
            held[p.pid] = None if p.used_mib is None or before is None else before + p.used_mib
    return held, sorted(gpus)


def wait_gpu_release(
    probe: GpuProbe,
    pids: Collection[int],
    *,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = POLL_S,
) -> float:
    """Block until no PID of `pids` holds GPU memory; returns the seconds waited.

    Raises GpuReleaseTimeout (naming PIDs and MiB) after `timeout_s`, or WorkerError when NVML
    kept failing until the deadline.
    """
    start = clock()
    deadline = start + timeout_s
    held: dict[int, float | None] = {}
    gpus: list[int] = []
    while True:
        try:
            held, gpus = held_by(probe, pids)
            error: Exception | None = None
        except Exception as e:  # NVMLError: a driver hiccup; retry until the deadline
            error = e
            logger.warning("NVML query failed while waiting for GPU memory release: %s", e)
        if error is None and not held:
            waited = clock() - start
            logger.info("GPU memory of pids %s released after %.1f s", sorted(pids), waited)
            return waited
        if clock() >= deadline:
            if error is not None:
                raise WorkerError(f"could not read GPU processes from NVML for {timeout_s:.0f} s: {error}") from error
            raise GpuReleaseTimeout(held, timeout_s, gpus)
        sleep(poll_s)
