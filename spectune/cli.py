"""`spectune`: hands `spectune worker` to the worker's own CLI, everything else to `api.cli`.

A GPU host may have the worker-only install (the wheel with its `sglang` or `sim` extra): no
FastAPI, Optuna or typer.  `spectune worker` therefore never imports `api/`, `spectune --help`
shows what such an install runs, and the other commands say what to install instead of failing
with an ImportError.
"""

from __future__ import annotations

import importlib.util
import sys

SERVER_EXTRA_HINT = (
    "install the server extra from the wheel `make dist` builds or a checkout: "
    "pip install '<spectune wheel or checkout>[server]'"
)
WORKER_ONLY_HELP = """usage: spectune COMMAND ...

This is a worker-only installation of spectune (no API server, no study commands).

commands:
  worker --config FILE   run the GPU-host agent (see `spectune worker --help`)
  doctor --config FILE   check this host for its first real run (see `spectune doctor --help`)
  --version              print the version

For the other commands ({hint}).
"""


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["worker"]:
        from workers.cli import main as worker_main

        sys.exit(worker_main(argv[1:]))
    if argv[:1] == ["doctor"]:  # a GPU host's check (workers/doctor/): runs from a worker-only install too
        from workers.doctor.run import main as doctor_main

        sys.exit(doctor_main(argv[1:]))
    if importlib.util.find_spec("typer") is None or importlib.util.find_spec("fastapi") is None:
        if argv[:1] == ["--version"]:
            from workers.cli import _version

            sys.stdout.write(f"spectune {_version()}\n")
            return
        if argv[:1] in ([], ["--help"], ["-h"]):
            sys.stdout.write(WORKER_ONLY_HELP.format(hint=SERVER_EXTRA_HINT))
            return
        sys.stderr.write(
            "error: this is a worker-only installation: it runs `spectune worker --config FILE` "
            f"(or `spectune-worker`); for the other commands, {SERVER_EXTRA_HINT}\n"
        )
        sys.exit(2)
    from api.cli import main as api_main

    api_main()
