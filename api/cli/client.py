"""User commands that talk to the API with a token: `spectune study ...` and `spectune report`.

`report` may also read the database directly (--database-url), for a server without the API up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from pydantic import TypeAdapter

from api.cli.common import DEFAULT_API_URL, ApiUrl, Token, call, client, ensure_utc, fail, read_yaml, say
from api.documents import StudyBrief, StudyDocument, StudySummary, TrialRow
from api.outcomes import EXIT_DOES_NOT_PAY, EXIT_STATUS, headline
from optimizer.study_state import Outcome

# `stop` answers the study document, or a brief one for a study whose stored spec this version cannot read.
_STOPPED: TypeAdapter[StudyDocument | StudyBrief] = TypeAdapter(StudyDocument | StudyBrief)

study_app = typer.Typer(no_args_is_help=True, help="Studies (talks to the API).")


def get_study(name: str, api_url: str, token: str | None) -> StudyDocument:
    """`GET /v1/studies/{name}` as its typed document."""
    return StudyDocument.model_validate(call("GET", f"/v1/studies/{name}", api_url, token))


def get_trials(name: str, api_url: str, token: str | None) -> list[TrialRow]:
    """`GET /v1/studies/{name}/trials` as typed rows."""
    return [TrialRow.model_validate(t) for t in call("GET", f"/v1/studies/{name}/trials", api_url, token)]


# `spectune study best` exits with this status when the verdict is "speculation does not pay here"
# (it then prints the command without speculation); every outcome's status is in api.outcomes.
EXIT_NO_SPECULATION = EXIT_DOES_NOT_PAY


@study_app.command("create")
def study_create(
    file: Annotated[Path, typer.Option("-f", "--file", help="spec as YAML or JSON")],
    api_url: ApiUrl = DEFAULT_API_URL,
    token: Token = None,
) -> None:
    """Create a study from a spec file."""
    data = read_yaml(file)
    out = StudyDocument.model_validate(call("POST", "/v1/studies", api_url, token, data))
    typer.echo(f"created study {out.name} ({out.state})")


@study_app.command("list")
def study_list(api_url: ApiUrl = DEFAULT_API_URL, token: Token = None) -> None:
    """Every study with its state and trial counts."""
    from api.report.tables import table

    rows = []
    for st in (StudySummary.model_validate(x) for x in call("GET", "/v1/studies", api_url, token)):
        t = st.trials
        rows.append([st.name, st.state, st.model, t.COMPLETE, t.RUNNING, t.FAIL])
    say(table(["study", "state", "model", "complete", "running", "failed"], rows))


@study_app.command("show")
def study_show(
    name: str,
    api_url: ApiUrl = DEFAULT_API_URL,
    token: Token = None,
    as_json: Annotated[bool, typer.Option("--json", help="the raw study document instead of tables")] = False,
) -> None:
    """The study, its best configuration, and a table of its trials with the key metrics.

    The first line is the outcome: pays, does not pay, cannot tell apart or no answer, with the
    status `spectune study best` exits with on it (0, 3, 5, 4).
    """
    from api.report.tables import failures_table, levels_table, study_summary, trials_table
    from api.report.tradeoff import tradeoff_table

    if as_json:
        typer.echo(json.dumps(call("GET", f"/v1/studies/{name}", api_url, token), indent=2, default=str))
        return  # JSON escapes controls itself
    shown = get_study(name, api_url, token)
    trials = get_trials(name, api_url, token)
    say(study_summary(shown))
    typer.echo("")
    say(levels_table(shown))
    tradeoff = tradeoff_table(shown, trials)
    if tradeoff:
        typer.echo("")
        typer.echo("Per-user against per-GPU throughput across the levels (* = the Pareto front):")
        say(tradeoff)
    typer.echo("")
    say(trials_table(shown, trials))
    failures = failures_table(trials)
    if failures:
        typer.echo("")
        say(failures)


@study_app.command("watch")
def study_watch(
    name: str,
    api_url: ApiUrl = DEFAULT_API_URL,
    token: Token = None,
    interval: Annotated[float, typer.Option(min=0.2, help="seconds between polls")] = 5.0,
    timeout: Annotated[float, typer.Option(min=0, help="give up after this many seconds (exit 1)")] = 24 * 3600.0,
) -> None:
    """Follow a study live: a line whenever something changes, until it is finished or stopped."""
    import time

    from api.report.tables import progress_line

    deadline = time.monotonic() + timeout
    last = ""
    while True:
        shown = get_study(name, api_url, token)
        line = progress_line(shown)
        if line != last:
            say(f"{time.strftime('%H:%M:%S', time.gmtime())}  {line}")
            last = line
        if shown.state != "running":
            say(headline(shown))
            say(shown.verdict)
            say(f"cost: {shown.cost.summary}")
            command = shown.printed_command()
            # As `best`: no answer prints no command a reader could deploy.
            if command is not None and shown.deployment is not None and shown.outcome != Outcome.NO_ANSWER:
                say(f"# {shown.deployment.load_line}")
                say(command)
            if shown.deployment is not None and shown.printed_command_note():
                say(f"# {shown.printed_command_note()}")
            return
        if time.monotonic() + interval > deadline:
            typer.secho(f"study {name} is still running after {timeout:.0f} s", err=True, fg=typer.colors.YELLOW)
            raise typer.Exit(1)
        time.sleep(interval)


@study_app.command("stop")
def study_stop(name: str, api_url: ApiUrl = DEFAULT_API_URL, token: Token = None) -> None:
    """Hand out no more trials (leases in flight may still report); `resume` undoes it."""
    out = _STOPPED.validate_python(call("POST", f"/v1/studies/{name}/stop", api_url, token))
    typer.echo(f"study {name} is {out.state}")


@study_app.command("resume")
def study_resume(name: str, api_url: ApiUrl = DEFAULT_API_URL, token: Token = None) -> None:
    """Hand out trials again to a stopped study, with the budget it has left."""
    out = StudyDocument.model_validate(call("POST", f"/v1/studies/{name}/resume", api_url, token))
    typer.echo(f"study {name} is {out.state}")


@study_app.command("export")
def study_export(
    name: str,
    api_url: ApiUrl = DEFAULT_API_URL,
    token: Token = None,
    fmt: Annotated[str, typer.Option("--format", help="csv: a row per trial and level; json: every document")] = "csv",
    output: Annotated[Path | None, typer.Option("-o", "--output", help="write here instead of stdout")] = None,
) -> None:
    """Every trial at every concurrency level, with its baseline, as CSV or JSON."""
    from api.report.export import to_csv, to_json

    if fmt not in ("csv", "json"):
        fail(f"unknown --format {fmt!r}; choose csv or json")
    shown = get_study(name, api_url, token)
    trials = get_trials(name, api_url, token)
    text = to_csv(name, trials, shown.confirmation) if fmt == "csv" else to_json(shown, trials) + "\n"
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as e:
        fail(f"cannot write {output}: {e.strerror}")
    typer.echo(f"wrote {output} ({len(trials)} trials)", err=True)


@study_app.command("best")
def study_best(
    name: str,
    api_url: ApiUrl = DEFAULT_API_URL,
    token: Token = None,
    fmt: Annotated[str, typer.Option("--format", help="sglang: the launch command; json: the settings")] = "sglang",
    worker_config: Annotated[
        Path | None,
        typer.Option(help="a worker TOML whose [models] registry gives the local model paths (else placeholders)"),
    ] = None,
    host: Annotated[str, typer.Option(help="--host of the printed server (0.0.0.0 answers other machines)")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="--port of the printed server")] = 30000,
) -> None:
    """The answer to deploy: SGLang's launch command sized by the study's `serving` section.

    The first line (on stderr) names the outcome; the command goes to stdout, the line above it
    saying the loads it was proven at and what it admits.  Exit status: 0 pays (the command runs
    speculative decoding); 3 does not pay (the command runs the same server without it);
    5 cannot tell apart (the best is above the baseline within noise; the command runs without
    speculation); 4 no answer (nothing measured yet, a saturated measurement, or no deployment
    started: no command is printed); 2 an error.
    """
    from optimizer.deploy import Deployment

    if fmt not in ("sglang", "json"):
        fail(f"unknown --format {fmt!r}; choose sglang or json")
    models: dict[str, str] = {}
    if worker_config is not None:
        from workers.config import read_model_registry
        from workers.errors import ConfigError

        try:
            models = read_model_registry(worker_config)
        except ConfigError as e:
            fail(str(e))
    shown = get_study(name, api_url, token)
    status = EXIT_STATUS[shown.outcome]
    answer = shown.deployment if shown.outcome != Outcome.NO_ANSWER else None
    doc = None if answer is None else answer.model_dump(mode="json")
    deployment = None if doc is None else Deployment.from_json(doc)
    command = None
    if deployment is not None:
        missing = [
            m for m in (deployment.settings.target, deployment.settings.draft) if m and models and m not in models
        ]
        if missing:
            fail(f"{worker_config} has no [models] entry for {', '.join(missing)}")
        command = deployment.command(models=models, host=host, port=port)
    if fmt == "sglang":
        typer.echo(f"# {headline(shown)}", err=True)
        if deployment is None or command is None:
            typer.echo(f"# study {name} ({shown.state}): {shown.verdict}", err=True)
            raise typer.Exit(status)
        if not deployment.speculation:
            typer.echo(f"# {shown.verdict}", err=True)
        if shown.printed_command_note():
            typer.echo(f"# {shown.printed_command_note()}", err=True)
        if deployment.load_note:
            typer.echo(f"# {deployment.load_note}", err=True)
        typer.echo(f"# {deployment.load_line()}", err=True)  # right above the command it sizes
        typer.echo(command)
    else:
        out = {
            "study": name,
            "state": shown.state,
            "outcome": shown.outcome.value,
            "exit_status": status,
            "verdict": shown.verdict,
            "speculation_pays": shown.speculation_pays,
            "winner": None if shown.winner is None else shown.winner.model_dump(mode="json"),
            "deployment": None if doc is None else doc | {"launch_command": command},
        }
        typer.echo(json.dumps(out, indent=2))
    raise typer.Exit(status)


def report(
    name: str,
    output: Annotated[Path, typer.Option("-o", "--output", help="the HTML file to write")] = Path("report.html"),
    database_url: Annotated[
        str | None,
        typer.Option("--database-url", envvar="SPECTUNE_DATABASE_URL", help="read the database directly"),
    ] = None,
    api_url: ApiUrl = DEFAULT_API_URL,
    token: Token = None,
    plots_dir: Annotated[Path | None, typer.Option(help="also write each plot as a PNG file here")] = None,
) -> None:
    """Write one self-contained HTML report (plots embedded) explaining a study.

    Reads the database directly with --database-url (or SPECTUNE_DATABASE_URL); otherwise asks
    the API with a token.
    """
    from api.report import ReportSourceError, build_report, load_from_api, load_from_database

    ensure_utc()
    try:
        if database_url:
            typer.echo(f"reading study {name} from the database", err=True)
            data = load_from_database(database_url, name)
        else:
            typer.echo(f"reading study {name} from {api_url}", err=True)
            with client(api_url, token) as api:
                data = load_from_api(api, name)
    except ReportSourceError as e:
        fail(str(e))
    typer.echo(f"{len(data.trials)} trials; drawing the plots", err=True)
    rendered = build_report(data)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(rendered.html, encoding="utf-8")
        if plots_dir is not None:
            plots_dir.mkdir(parents=True, exist_ok=True)
            for plot in rendered.plots:
                (plots_dir / f"{plot.name}.png").write_bytes(plot.png)
    except OSError as e:
        fail(f"cannot write the report: {e}")
    typer.echo(f"wrote {output} ({len(rendered.plots)} plots, {len(rendered.html) // 1024} KiB)")
