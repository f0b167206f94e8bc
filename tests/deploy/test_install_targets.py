"""`make demo` installs no torch (issue 33 item 7): the demo's setup is `.[server,sim]` only; torch
(the `gp` sampler's, as a CPU build) comes with `make setup` / `make torch-cpu`, never the demo.

The Makefile runs on a copy of the checkout into a fresh venv, the way a new user's clone would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import copy_checkout

pytestmark = pytest.mark.slow


def test_the_demo_setup_installs_no_torch(tmp_path: Path) -> None:
    checkout = copy_checkout(tmp_path / "checkout")
    venv = tmp_path / "venv"
    make = ["make", "-C", str(checkout), f"VENV={venv}", f"PY={sys.executable}"]
    # The time-out bounds a hung install; it is not a speed budget.
    r = subprocess.run([*make, "demo-setup"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    listed = subprocess.run(
        [str(venv / "bin" / "pip"), "list", "--format", "json"], capture_output=True, text=True, check=True
    )
    names = {d["name"].lower().replace("_", "-") for d in json.loads(listed.stdout)}
    assert {"spectune", "optuna", "fastapi", "uvicorn"} <= names, sorted(names)
    # NVML's bindings (nvidia-ml-py, pure Python) are the base install's; CUDA's libraries are not.
    cuda = sorted(n for n in names if n == "torch" or n.startswith(("nvidia-c", "nvidia-n", "triton")))
    assert not cuda, cuda
    # `make demo` would now only run the demo: nothing more to install, torch least of all.
    dry = subprocess.run([*make, "-n", "demo"], capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "spectune demo" in dry.stdout and "pip" not in dry.stdout and "torch" not in dry.stdout, dry.stdout
    # ... while `make setup` (what `make test` runs) would add torch, as the CPU build.
    dry = subprocess.run([*make, "-n", "setup"], capture_output=True, text=True, timeout=60)
    assert "torch==2.13.0+cpu" in dry.stdout and "[server,gp,sim,dev]" in dry.stdout, dry.stdout
    r = subprocess.run([str(venv / "bin" / "spectune"), "demo", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--workdir" in r.stdout, r.stderr
