"""`spectune`: hands `spectune worker` to the worker's own CLI, everything else to `api.cli`.

A GPU host may have the worker-only install (`pip install 'spectune[sglang]'`): no FastAPI,
Optuna or typer.  `spectune worker` therefore never imports `api/`, and the other commands say
what to install instead of failing with an ImportError.
"""

from __future__ import annotations

import importlib.util
import sys

SERVER_EXTRA_HINT = "pip install 'spectune[server]'"


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["worker"]:
        from workers.cli import main as worker_main

        sys.exit(worker_main(argv[1:]))
    if importlib.util.find_spec("typer") is None or importlib.util.find_spec("fastapi") is None:
        if argv[:1] == ["--version"]:
            from workers.cli import _version

            sys.stdout.write(f"spectune {_version()}\n")
            return
        sys.stderr.write(
            "error: this is a worker-only installation: it runs `spectune worker --config FILE` "
            f"(or `spectune-worker`); for the other commands, {SERVER_EXTRA_HINT}\n"
        )
        sys.exit(2)
    from api.cli import main as api_main

    api_main()
