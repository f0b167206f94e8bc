"""Which SGLang the engine interpreter has: its flag names depend on it (docs/sglang.md §1)."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping

from optimizer.sglang import parse_version
from workers.errors import ConfigError
from workers.launcher.supported import unsupported_reason

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
            f"SGLang is not installed for {python!r}: install a supported version there (pip install 'sglang==0.5.23'), "
            "point engine.python at the interpreter that has it, or set sglang_version to override detection"
        )
    if done.returncode != 0:
        raise ConfigError(
            f"could not ask {python!r} for its SGLang version (exit {done.returncode}): {done.stderr.strip()[-500:]}"
        )
    return _checked(done.stdout.strip(), source=f"sglang installed for {python}")


def _checked(version: str, *, source: str) -> str:
    """The version, when spectune supports it (workers/launcher/supported.py); else ConfigError.

    Only versions whose wheel passed the conformance check are launched: a flag renamed or a
    default changed in another release would fail on the first launch, or worse, run a server
    other than the one measured.
    """
    try:
        parse_version(version)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from e
    reason = unsupported_reason(version)
    if reason is not None:
        raise ConfigError(f"{source}: {reason}")
    return version.strip().lstrip("v")
