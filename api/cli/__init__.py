"""The `spectune` command line: server, worker, demo, study, workers, db, token, bench, report.

The commands live by who runs them: `admin` (the server's operator: server, worker, demo, db,
token), `client` (a user with a token: study, report) and `bench` (measure given
configurations); this module puts them under one root, in the order `--help` lists them.
Errors a user can fix are printed as one line (no traceback) and exit with status 2.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from api.cli import admin, bench, client, fleet
from api.cli import plan as _plan  # noqa: F401 - registers `study plan` on the study commands
from api.cli.bench import bench_spec
from api.cli.client import EXIT_NO_SPECULATION
from api.cli.common import version
from api.outcomes import EXIT_CANNOT_TELL_APART, EXIT_NO_ANSWER, EXIT_PAYS

__all__ = ["EXIT_CANNOT_TELL_APART", "EXIT_NO_ANSWER", "EXIT_NO_SPECULATION", "EXIT_PAYS", "app", "bench_spec", "main"]

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Tune SGLang EAGLE-3 speculative decoding by Bayesian optimisation over real measurements.",
)
for command in (admin.server, admin.worker, admin.demo, bench.bench, client.report):
    app.command()(command)
app.add_typer(admin.db_app, name="db")
app.add_typer(admin.token_app, name="token")
app.add_typer(client.study_app, name="study")
app.add_typer(fleet.workers_app, name="workers")


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"spectune {version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True, help="print the version and exit"),
    ] = False,
) -> None:
    """Tune SGLang EAGLE-3 speculative decoding by Bayesian optimisation over real measurements."""


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - a bug still gets one line; the traceback on request
        if os.environ.get("SPECTUNE_DEBUG"):
            raise
        typer.secho(f"error: {type(e).__name__}: {e} (set SPECTUNE_DEBUG=1 for the traceback)", err=True, fg="red")
        sys.exit(2)
