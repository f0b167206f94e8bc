"""Which SGLang the engine interpreter has: its flag names depend on it (docs/sglang.md §1)."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Mapping

from optimizer.sglang import parse_version
from workers.errors import ConfigError

logger = logging.getLogger("spectune.worker.launcher")

# Oldest line whose flags optimizer.sglang knows; older ones are launched with legacy names, unchecked.
OLDEST_SUPPORTED = (0, 5, 13)

# Run inside the engine's interpreter: importing sglang itself would take seconds and touch CUDA.
_PROBE = (
    "import importlib.metadata as m, sys\n"
    "try:\n"
    "    print(m.version('sglang'))\n"
    "except m.PackageNotFoundError:\n"
    "    sys.exit(3)\n"
)
_NOT_INSTALLED = 3


def detect_sglang_version(
    python: str,
    override: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> str:
    """The SGLang version installed for `python` (e.g. "0.5.23"), or `override` when given.

    `env` is the environment to run the interpreter with (default: inherited); pass the server's
    environment when the config adds e.g. PYTHONPATH.  Raises ConfigError with the fix.
    """
    if override is not None:
        return _checked(override, source="the worker config's sglang_version")
    argv = [python, "-c", _PROBE]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except FileNotFoundError as e:
        raise ConfigError(f"engine interpreter {python!r} does not exist; set engine.python to SGLang's python") from e
    except PermissionError as e:
        raise ConfigError(f"engine interpreter {python!r} is not executable: {e}") from e
    except subprocess.TimeoutExpired as e:
        raise ConfigError(f"engine interpreter {python!r} did not answer within {timeout_s:.0f} s") from e
    if done.returncode == _NOT_INSTALLED:
        raise ConfigError(
            f"SGLang is not installed for {python!r}: install it there (pip install 'sglang>=0.5.13'), "
            "point engine.python at the interpreter that has it, or set sglang_version to override detection"
        )
    if done.returncode != 0:
        raise ConfigError(
            f"could not ask {python!r} for its SGLang version (exit {done.returncode}): {done.stderr.strip()[-500:]}"
        )
    return _checked(done.stdout.strip(), source=f"sglang installed for {python}")


def _checked(version: str, *, source: str) -> str:
    try:
        parsed = parse_version(version)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from e
    if parsed < OLDEST_SUPPORTED:
        logger.warning(
            "SGLang %s (%s) is older than %s, the oldest line spectune knows; launching with legacy flag names",
            version,
            source,
            ".".join(map(str, OLDEST_SUPPORTED)),
        )
    return version.strip().lstrip("v")
