"""`spectune worker` (and `spectune-worker`): the GPU-host agent's command line.

Deliberately argparse and nothing of `api/`: a worker-only install (the wheel with its
`sglang` extra) has no FastAPI, Optuna, typer or matplotlib, and this must still run there
(`tests/e2e/test_worker_install.py` checks it in a clean virtualenv).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spectune")
    except PackageNotFoundError:
        return "unknown (not installed)"


def parser(prog: str = "spectune worker") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run the GPU-host agent: lease work from the spectune API, launch SGLang with its "
        "settings, benchmark it, report back.  Stops cleanly on SIGTERM (a second one kills).",
    )
    p.add_argument(
        "-c", "--config", type=Path, required=True, help="worker TOML file (see workers/worker.example.toml)"
    )
    p.add_argument("--version", action="version", version=f"spectune {_version()}")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "spectune worker") -> int:
    """Parse the arguments and run the agent until it stops; returns the exit status (2: bad config)."""
    args = parser(prog).parse_args(argv)
    # Optuna-side timestamps are UTC; the worker's logs and reports use the same clock.
    os.environ["TZ"] = "UTC"
    time.tzset()
    from workers.lifeline import exit_with_parent
    from workers.main import main as agent_main

    exit_with_parent()
    return agent_main(args.config)


def entry() -> None:
    """The `spectune-worker` console script."""
    sys.exit(main(prog="spectune-worker"))
