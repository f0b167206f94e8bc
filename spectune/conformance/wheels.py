"""SGLang's wheels, downloaded once with pip and kept in a cache, verified by their sha256.

The cache is `$SPECTUNE_WHEEL_CACHE`, else `$XDG_CACHE_HOME/spectune/sglang-wheels`, else
`~/.cache/spectune/sglang-wheels`; CI keeps that folder between runs.  A cached file whose hash
is not the listed one is downloaded again, never read.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from spectune.conformance.errors import WheelError
from workers.launcher.supported import SUPPORTED_SGLANG, Wheel

# pip's own retries cover a flaky network; this bounds one version's download (the largest
# supported wheel is 39 MB).
DOWNLOAD_TIMEOUT_S = 600.0


def cache_dir() -> Path:
    if override := os.environ.get("SPECTUNE_WHEEL_CACHE"):
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spectune" / "sglang-wheels"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def retry_command(version: str) -> str:
    return f"{sys.executable} -m spectune.conformance --version {version}"


def _download_argv(version: str, dest: Path) -> list[str]:
    # The listed build exactly (cp311, manylinux_2_34), whatever interpreter runs the check: its
    # source is what was read when the hash was listed.
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
        "--platform", "manylinux_2_34_x86_64", "--disable-pip-version-check", "--quiet",
        "--dest", str(dest), f"sglang=={version}",
    ]  # fmt: skip


def fetch(version: str, *, cache: Path | None = None) -> Path:
    """The verified wheel of a supported `version`, from the cache or downloaded into it."""
    wheel: Wheel | None = SUPPORTED_SGLANG.get(version)
    if wheel is None:
        raise WheelError(f"SGLang {version} is not in workers/launcher/supported.py; add it there with its sha256")
    folder = cache or cache_dir()
    target = folder / wheel.filename
    if target.is_file() and sha256_of(target) == wheel.sha256:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        argv = _download_argv(version, Path(tmp))
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False
            )
        except subprocess.TimeoutExpired as e:
            raise WheelError(
                f"downloading SGLang {version} took over {DOWNLOAD_TIMEOUT_S:.0f} s; retry: {retry_command(version)}"
            ) from e
        got = Path(tmp) / wheel.filename
        if done.returncode != 0 or not got.is_file():
            why = (done.stderr.strip().splitlines() or [f"pip exit {done.returncode}, no {wheel.filename}"])[-1]
            raise WheelError(
                f"could not download SGLang {version} ({why}); check the network or a pip index, then retry: "
                f"{retry_command(version)}"
            )
        digest = sha256_of(got)
        if digest != wheel.sha256:
            raise WheelError(
                f"{wheel.filename} has sha256 {digest}, not the listed {wheel.sha256}: the file on the index "
                "changed; find out why before changing workers/launcher/supported.py"
            )
        os.replace(got, target)  # atomic: a parallel run sees the old state or the whole file
    return target
