"""What this host tells the API each time it asks for work (spectune_protocol.Inventory).

GPUs come from NVML when a driver is present (the `gpus` list in the config narrows them to the
ones this worker may use); without a driver (a CPU box driving the simulated engine) the list is
empty.  Two labels are derived so that a study's `placement` can ask for hardware without every
operator writing them by hand: `gpu_model` and `gpu_count`.  Labels from the config win.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from importlib import metadata

from spectune_protocol import GpuInfo, Inventory
from workers.gpu import GpuProbe

log = logging.getLogger("spectune.worker.inventory")


def spectune_version() -> str | None:
    try:
        return metadata.version("spectune")
    except metadata.PackageNotFoundError:
        return None


def gpu_inventory(probe: GpuProbe | None, only: Sequence[int] | None) -> tuple[list[GpuInfo], str | None]:
    """The GPUs this worker may use and the driver version; ([], None) without NVML."""
    if probe is None:
        return [], None
    devices = probe.devices()
    if only is not None:
        present = {d.index for d in devices}
        missing = sorted(set(only) - present)
        if missing:
            log.warning("configured GPU(s) %s not found by NVML (present: %s)", missing, sorted(present))
        devices = [d for d in devices if d.index in set(only)]
    gpus = [GpuInfo(index=d.index, name=d.name[:128], memory_mib=int(d.memory_total_mib)) for d in devices]
    return gpus, probe.driver_version()


def build_inventory(
    *,
    sglang_version: str,
    models: Sequence[str],
    labels: dict[str, str],
    probe: GpuProbe | None,
    gpus: Sequence[int] | None = None,
    hostname: str | None = None,
) -> Inventory:
    found, driver = gpu_inventory(probe, gpus)
    derived: dict[str, str] = {"gpu_count": str(len(found))}
    names = sorted({g.name for g in found})
    if names:
        derived["gpu_model"] = names[0] if len(names) == 1 else "mixed"
    return Inventory(
        hostname=(hostname or socket.gethostname())[:255],
        gpus=found,
        driver_version=driver,
        sglang_version=sglang_version,
        models=sorted(models),
        labels={**derived, **labels},
        spectune_version=spectune_version(),
    )


def describe(inv: Inventory) -> str:
    """One log line: the host as the API will see it."""
    if inv.gpus:
        gpus = f"{len(inv.gpus)} GPU(s) {', '.join(sorted({g.name for g in inv.gpus}))}, driver {inv.driver_version}"
    else:
        gpus = "no GPUs visible"
    return (
        f"host {inv.hostname}: {gpus}; SGLang {inv.sglang_version}; "
        f"models {', '.join(inv.models) or 'none'}; labels {inv.labels or '{}'}"
    )
