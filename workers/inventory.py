"""What this host tells the API each time it asks for work (spectune_protocol.Inventory).

GPUs come from NVML when a driver is present (the `gpus` list in the config narrows them to the
ones this worker may use); without a driver (a CPU box driving the simulated engine) the list is
empty.  Two labels are derived so that a study's `placement` can ask for hardware without every
operator writing them by hand: `gpu_model` and `gpu_count`.  Labels from the config win.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path

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


# At most this many prompt files are advertised (spectune_protocol.Inventory.prompt_files).
MAX_PROMPT_FILES = 1024


def prompt_files(prompt_dir: Path | None) -> list[str]:
    """The plain files of the prompt folder a workload may name, sorted (none without a folder)."""
    from workers.loadgen.prompts import is_prompt_file_name

    if prompt_dir is None:
        return []
    names = sorted(p.name for p in prompt_dir.iterdir() if is_prompt_file_name(p.name) and p.is_file())
    if len(names) > MAX_PROMPT_FILES:
        log.warning(
            "prompt_dir %s holds %d files; only the first %d are advertised", prompt_dir, len(names), MAX_PROMPT_FILES
        )
    return names[:MAX_PROMPT_FILES]


def config_digest(
    *,
    allowed_extra_args: Sequence[str],
    models: Mapping[str, Path],
    prompt_dir: Path | None,
    files: Sequence[str],
    sglang_version: str,
    engine_python: str | Path,
    engine_module: str,
    gpus: Sequence[GpuInfo],
) -> str:
    """A digest of what decides what this worker refuses: its flag allowlist, its model registry,
    its prompt files (name, size, modification time), the engine it runs (SGLang's version, the
    interpreter and module: an unknown flag is cured by an upgrade) and the GPUs it may use
    (index, model, memory: an OOM is cured by bigger ones).  The API ends the worker's refusals
    when it changes, so a fixed host is offered the studies it refused before."""
    stats = {}
    for name in files:
        st = (prompt_dir / name).stat() if prompt_dir is not None else None
        stats[name] = None if st is None else [st.st_size, st.st_mtime_ns]
    blob = json.dumps(
        {
            "allowed_extra_args": sorted(allowed_extra_args),
            "models": {k: str(v) for k, v in sorted(models.items())},
            "prompt_files": stats,
            "sglang_version": sglang_version,
            "engine": [str(engine_python), engine_module],
            "gpus": sorted([g.index, g.name, g.memory_mib] for g in gpus),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def build_inventory(
    *,
    sglang_version: str,
    models: Sequence[str],
    labels: dict[str, str],
    probe: GpuProbe | None,
    gpus: Sequence[int] | None = None,
    hostname: str | None = None,
    digest: str | None = None,
    files: Sequence[str] = (),
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
        config_digest=digest,
        prompt_files=list(files),
    )


def describe(inv: Inventory) -> str:
    """One log line: the host as the API will see it."""
    if inv.gpus:
        gpus = f"{len(inv.gpus)} GPU(s) {', '.join(sorted({g.name for g in inv.gpus}))}, driver {inv.driver_version}"
    else:
        gpus = "no GPUs visible"
    return (
        f"host {inv.hostname}: {gpus}; SGLang {inv.sglang_version}; "
        f"models {', '.join(inv.models) or 'none'}; prompt files {', '.join(inv.prompt_files) or 'none'}; "
        f"labels {inv.labels or '{}'}; config digest {inv.config_digest}"
    )
