"""What the NVIDIA driver says about this host's GPUs, through NVML (pynvml from nvidia-ml-py).

The launcher needs two things from it: the inventory (name, memory, driver) the worker reports,
and the per-GPU list of compute processes with the memory each holds, to wait after a stop until
the driver has really freed the old server's memory (it does so asynchronously; docs/sglang.md
§10).  `open_probe()` returns None where there is no driver or no pynvml, and callers then skip
those checks.

PIDs: NVML reports PIDs as the host kernel sees them.  A worker inside a container with its own
PID namespace sees other numbers, and its release wait would then never match; run the worker in
the host's PID namespace (docker `--pid=host`) on GPU hosts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger("spectune.worker.gpu")

_MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuDevice:
    index: int  # NVML index (PCI bus order; the launcher sets CUDA_DEVICE_ORDER=PCI_BUS_ID to match)
    name: str
    uuid: str
    memory_total_mib: float
    memory_used_mib: float


@dataclass(frozen=True)
class GpuProcess:
    gpu_index: int
    pid: int
    used_mib: float | None  # None where the driver does not account per process


class GpuProbe(Protocol):
    """Read-only view of the GPUs; `NvmlProbe` is the real one, tests may pass their own."""

    def devices(self) -> list[GpuDevice]: ...

    def compute_processes(self) -> list[GpuProcess]: ...

    def driver_version(self) -> str | None: ...


def _text(value: Any) -> str:
    # pynvml returned bytes before 11.5 and str since; accept both.
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlProbe:
    """GpuProbe over NVML.  Construct with `open_probe()`; `close()` shuts NVML down."""

    def __init__(self, nvml: Any) -> None:
        # `nvml` is the pynvml module, already initialised (injected so the import stays optional).
        self._nvml = nvml

    def _handles(self) -> list[tuple[int, Any]]:
        n = int(self._nvml.nvmlDeviceGetCount())
        return [(i, self._nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(n)]

    def devices(self) -> list[GpuDevice]:
        out = []
        for i, h in self._handles():
            mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
            out.append(
                GpuDevice(
                    index=i,
                    name=_text(self._nvml.nvmlDeviceGetName(h)),
                    uuid=_text(self._nvml.nvmlDeviceGetUUID(h)),
                    memory_total_mib=mem.total / _MIB,
                    memory_used_mib=mem.used / _MIB,
                )
            )
        return out

    def compute_processes(self) -> list[GpuProcess]:
        out = []
        for i, h in self._handles():
            for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(h):
                used = p.usedGpuMemory
                out.append(GpuProcess(gpu_index=i, pid=int(p.pid), used_mib=None if used is None else used / _MIB))
        return out

    def driver_version(self) -> str | None:
        return _text(self._nvml.nvmlSystemGetDriverVersion())

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception as e:  # NVMLError: already shut down, or the driver went away
            logger.debug("nvmlShutdown failed: %s", e)


def open_probe() -> NvmlProbe | None:
    """An initialised NVML probe, or None (logged once per call) when pynvml or the driver is absent."""
    try:
        import pynvml
    except ImportError:
        logger.info("pynvml is not installed (pip install nvidia-ml-py): GPU checks are skipped")
        return None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # pynvml.NVMLError_LibraryNotFound / DriverNotLoaded / ...
        logger.info("NVML is not available (%s): no NVIDIA driver here, GPU checks are skipped", e)
        return None
    return NvmlProbe(pynvml)
