"""How the worker runs its engine: interpreter, module, address, time-outs, environment."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from workers.errors import ConfigError
from workers.lifeline import ENV as LIFELINE_ENV
from workers.lifeline import RUN_ID_ENV

# `python -m <module>`: a dotted module name only, never a path or command text.
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")

# What the server inherits from the worker's environment.  Everything else (secrets of the worker,
# its API token path, stray SGLANG_* tweaks) stays out; the config's `env` adds what a host needs.
_INHERITED = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "LD_LIBRARY_PATH",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDA_VISIBLE_DEVICES",  # replaced when the config names gpu_indices
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "XDG_CACHE_HOME",
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "FLASHINFER_WORKSPACE_BASE",
        RUN_ID_ENV,  # finds every process of one run, engines included (workers/lifeline.py)
    }
)
_INHERITED_PREFIXES = ("LC_", "NCCL_")


@dataclass(frozen=True)
class EngineConfig:
    python: str  # interpreter that has sglang (sys.executable for the simulator)
    module: str = "sglang.launch_server"  # "spectune_sim" for the simulated engine
    host: str = "127.0.0.1"
    port: int = 30000
    env: Mapping[str, str] = field(default_factory=dict)  # extra env for the server
    log_dir: Path = Path("/var/log/spectune")
    startup_timeout_s: float = 1200.0  # large MoE servers take 10-15 min (docs/sglang.md §13)
    stop_timeout_s: float = 60.0
    gpu_release_timeout_s: float = 120.0
    gpu_indices: tuple[int, ...] | None = None  # CUDA_VISIBLE_DEVICES for the server
    sglang_version: str | None = None  # override detection

    def __post_init__(self) -> None:
        if not _MODULE_RE.match(self.module):
            raise ConfigError(
                f"engine module {self.module!r} is not a Python module name; give e.g. 'sglang.launch_server' "
                "(it is run as `python -m <module>`, never through a shell)"
            )
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"engine port {self.port} is out of range 1..65535")
        for name in ("startup_timeout_s", "stop_timeout_s", "gpu_release_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"engine {name} must be positive, got {getattr(self, name)}")
        if self.gpu_indices is not None and (not self.gpu_indices or any(i < 0 for i in self.gpu_indices)):
            raise ConfigError(f"engine gpu_indices must be non-empty and >= 0, got {self.gpu_indices}")

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def server_env(engine: EngineConfig, inherited: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: a minimal part of `inherited` (default os.environ) + engine.env."""
    source = os.environ if inherited is None else inherited
    env = {k: v for k, v in source.items() if k in _INHERITED or k.startswith(_INHERITED_PREFIXES)}
    # Logs reach the file as they are written, so the tail explains a death.
    env["PYTHONUNBUFFERED"] = "1"
    if engine.gpu_indices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in engine.gpu_indices)
        # CUDA numbers GPUs fastest-first by default, NVML by PCI bus: make the indices agree.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env.update(engine.env)
    # The engine follows this worker if it dies without stopping it (workers/lifeline.py).
    env[LIFELINE_ENV] = str(os.getpid())
    return env
