"""What a worker checks of itself before it asks for any work (`spectune worker` start-up).

A worker that cannot run its engine must not take leases: each one would launch, crash and count
against the host until it is quarantined, and the study would wait on a retry.  So before the
first lease the worker checks, in the engine's own interpreter and environment, that the engine's
module imports (for a package run as `python -m package`, the modules its `__main__` imports,
without running it), that the prompt folder it advertises is there, and that the GPUs its config
names are the GPUs NVML sees.  Any failure is a `ConfigError` with one line that says what to fix:
the worker exits 2 and systemd does not restart it (RestartPreventExitStatus=2).

The interpreter is run with a fixed program and the module name as an argument: no shell, no
string built from the config.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from workers.errors import ConfigError
from workers.gpu import GpuProbe

# Run as `python -c _IMPORT_CHECK MODULE` in the engine's interpreter.  Prints one line
# "ErrorType: message" on failure and exits 3; nothing is started.
_IMPORT_CHECK = """\
import ast, importlib, importlib.util, sys
name = sys.argv[1]
try:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {name!r}")
    if spec.submodule_search_locations is not None:
        main = importlib.util.find_spec(name + ".__main__")
        if main is None or main.loader is None:
            raise ImportError(f"{name} is a package without __main__: `python -m {name}` cannot run it")
        for node in ast.parse(main.loader.get_source(main.name) or "").body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                importlib.import_module(node.module)
    else:
        importlib.import_module(name)
except Exception as e:
    sys.stderr.write(f"{type(e).__name__}: {e}\\n")
    sys.exit(3)
"""
_IMPORT_FAILED = 3


def check_engine_imports(python: str, module: str, *, env: Mapping[str, str], timeout_s: float = 300.0) -> None:
    """The engine's module imports in the engine's interpreter, or ConfigError with the reason."""
    try:
        done = subprocess.run(
            [python, "-c", _IMPORT_CHECK, module],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            check=False,
            start_new_session=True,
        )
    except OSError as e:
        raise ConfigError(
            f"engine.python: cannot run {python} ({e.strerror}); point it at the engine's interpreter"
        ) from e
    except subprocess.TimeoutExpired as e:
        raise ConfigError(f"engine.module: importing {module} with {python} took over {timeout_s:.0f} s") from e
    if done.returncode == 0:
        return
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    reason = lines[-1][:300] if lines else f"exit status {done.returncode}"
    raise ConfigError(
        f"engine.module: {module} does not import with {python} ({reason}); install the engine and its "
        "dependencies into that interpreter (the wheel's `sglang` extra, or `sim` for spectune_sim), "
        "or point engine.python at the interpreter that has them"
    )


def check_gpus(probe: GpuProbe | None, wanted: Sequence[int] | None, labels: Mapping[str, str]) -> None:
    """The GPUs the config names (and a hand-set `gpu_count` label) are what NVML sees."""
    label = labels.get("gpu_count")
    if probe is None:
        return  # no NVIDIA driver (a simulated engine): nothing to compare with
    present = sorted(d.index for d in probe.devices())
    if wanted is not None:
        missing = sorted(set(wanted) - set(present))
        if missing:
            raise ConfigError(
                f"gpus: GPU index(es) {missing} are not on this host (NVML sees {present or 'none'}); "
                "fix the `gpus` list in the worker config"
            )
    usable = len(wanted) if wanted is not None else len(present)
    if label is not None and label != str(usable):
        raise ConfigError(
            f"labels.gpu_count: the config says {label} but this worker may use {usable} GPU(s); "
            "remove the label (it is derived) or fix it"
        )


def check_prompt_dir(prompt_dir: Path | None) -> None:
    """The prompt folder the worker advertises its files from is still a readable folder."""
    if prompt_dir is None:
        return
    try:
        next(iter(prompt_dir.iterdir()), None)
    except OSError as e:
        raise ConfigError(f"prompt_dir: cannot list {prompt_dir} ({e.strerror})") from e
