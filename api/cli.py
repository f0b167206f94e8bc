"""The `spectune` command line: server, worker, demo, study, db, token.

Errors a user can fix are printed as one line (no traceback) and exit with status 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from workers.lifeline import exit_with_parent

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Tune SGLang EAGLE-3 speculative decoding by Bayesian optimisation over real measurements.",
)
db_app = typer.Typer(no_args_is_help=True, help="Database schema.")
token_app = typer.Typer(no_args_is_help=True, help="API tokens (talks to the database directly).")
study_app = typer.Typer(no_args_is_help=True, help="Studies (talks to the API).")
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")
app.add_typer(study_app, name="study")

DbUrl = Annotated[
    str | None,
    typer.Option("--database-url", envvar="SPECTUNE_DATABASE_URL", help="default: sqlite:///./spectune.db"),
]
ApiUrl = Annotated[str, typer.Option("--api-url", envvar="SPECTUNE_API_URL")]
Token = Annotated[str | None, typer.Option("--token", envvar="SPECTUNE_TOKEN", help="bearer token (or SPECTUNE_TOKEN)")]


class CliError(Exception):
    """A problem the user can fix; printed without a traceback."""


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spectune")
    except PackageNotFoundError:  # run from a source tree without an install
        return "unknown (not installed)"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"spectune {_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True, help="print the version and exit"),
    ] = False,
) -> None:
    """Tune SGLang EAGLE-3 speculative decoding by Bayesian optimisation over real measurements."""


def _settings(database_url: str | None) -> Any:
    from api.settings import Settings

    return Settings(database_url=database_url) if database_url else Settings()


def _ensure_utc() -> None:
    # Optuna stores naive UTC timestamps; run everything in UTC (docs/optuna.md §1).
    os.environ["TZ"] = "UTC"
    if hasattr(__import__("time"), "tzset"):
        __import__("time").tzset()


@app.command()
def server(
    database_url: DbUrl = None,
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to bind")] = 8000,
) -> None:
    """Run the API (uvicorn).  Refuses to start on an old schema."""
    import uvicorn

    from api.app import create_app
    from api.db import make_engine
    from api.errors import SchemaOutdatedError
    from api.schema import check_current

    _ensure_utc()
    settings = _settings(database_url)
    engine = make_engine(settings.database_url)
    try:
        check_current(engine)
    except SchemaOutdatedError as e:
        _fail(e.message)
    except Exception as e:  # noqa: BLE001 - e.g. the database is unreachable
        _fail(f"cannot open the database {engine.url.render_as_string(hide_password=True)}: {e}")
    finally:
        engine.dispose()
    exit_with_parent()
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info")


@app.command()
def worker(config: Annotated[Path, typer.Option("--config", "-c", help="worker TOML file")]) -> None:
    """Run the GPU-host agent: lease, launch SGLang, benchmark, report."""
    # The worker's own CLI (workers/cli.py): it also runs from a worker-only install, without api/.
    from workers.cli import main as worker_main

    raise typer.Exit(worker_main(["--config", str(config)]))


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option(help="where the demo keeps its database and logs")] = Path("./spectune-demo"),
    landscape: Annotated[str, typer.Option(help="simulated engine landscape")] = "moe-pcie",
    trials: Annotated[int, typer.Option(help="max trials")] = 20,
    deadline_s: Annotated[
        float, typer.Option(help="stop the study after this many seconds and show what it found")
    ] = 280.0,
) -> None:
    """Run a whole study on the embedded default: SQLite, the API, two simulated workers."""
    _ensure_utc()
    try:
        from api.demo import run_demo
    except ImportError as e:
        _fail(f"the demo is not available in this installation: {e}")
    raise typer.Exit(run_demo(workdir=workdir, landscape=landscape, max_trials=trials, deadline_s=deadline_s))


@db_app.command("upgrade")
def db_upgrade(database_url: DbUrl = None) -> None:
    """Create or upgrade spectune's and Optuna's tables to head (run once per deploy)."""
    from api.schema import upgrade

    _ensure_utc()
    settings = _settings(database_url)
    try:
        upgrade(settings.database_url)
    except Exception as e:  # noqa: BLE001 - any failure here is reported as one line
        _fail(f"upgrade failed: {e}")
    typer.echo("database schema is at head")


@token_app.command("create")
def token_create(
    role: Annotated[str, typer.Option(help="admin | user | worker")],
    name: Annotated[str, typer.Option(help="a label for the token")] = "",
    worker_id: Annotated[str | None, typer.Option(help="bind a worker token to one worker id")] = None,
    database_url: DbUrl = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="write the token to this file (mode 0600) instead of stdout")
    ] = None,
) -> None:
    """Create a token and print it (shown once; only its hash is stored)."""
    from api.auth import create_token
    from api.db import make_engine, make_sessionmaker
    from api.errors import ApiError

    settings = _settings(database_url)
    engine = make_engine(settings.database_url)
    try:
        _, token = create_token(make_sessionmaker(engine), role, name, worker_id)
    except ApiError as e:
        _fail(e.message)
    except Exception as e:  # noqa: BLE001
        _fail(f"cannot create the token ({e}); did you run `spectune db upgrade`?")
    finally:
        engine.dispose()
    if output is None:
        typer.echo(token)
        return
    try:
        # Created 0600 from the start: the token is never readable by others, not even briefly.
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(token + "\n")
        os.chmod(output, 0o600)
    except OSError as e:
        _fail(f"cannot write the token to {output}: {e.strerror}")
    typer.echo(f"{role} token written to {output}")


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[int, typer.Argument(help="id from `spectune token list`")], database_url: DbUrl = None
) -> None:
    """Revoke a token: it (and any dashboard session made with it) stops working at once."""
    from api.auth import revoke_token
    from api.db import make_engine, make_sessionmaker
    from api.errors import ApiError

    engine = make_engine(_settings(database_url).database_url)
    try:
        revoke_token(make_sessionmaker(engine), token_id)
    except ApiError as e:
        _fail(e.message)
    finally:
        engine.dispose()
    typer.echo(f"token {token_id} revoked")


@token_app.command("list")
def token_list(database_url: DbUrl = None) -> None:
    """Every token: id, role, state, name and bound worker (never the token itself)."""
    from api.auth import list_tokens
    from api.db import make_engine, make_sessionmaker

    engine = make_engine(_settings(database_url).database_url)
    try:
        for t in list_tokens(make_sessionmaker(engine)):
            state = "revoked" if t.revoked_at else "active"
            bound = f" worker={t.worker_id}" if t.worker_id else ""
            typer.echo(f"{t.id}\t{t.role}\t{state}\t{t.name}{bound}")
    finally:
        engine.dispose()


def _client(api_url: str, token: str | None) -> Any:
    import httpx

    if not token:
        _fail("no token: pass --token or set SPECTUNE_TOKEN (create one with `spectune token create --role user`)")
    return httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30.0)


def _call(method: str, path: str, api_url: str, token: str | None, body: Any = None) -> Any:
    import httpx

    with _client(api_url, token) as c:
        try:
            r = c.request(method, path, json=body)
        except httpx.HTTPError as e:
            _fail(f"cannot reach the API at {api_url}: {e}")
    if r.status_code >= 400:
        try:
            msg = r.json().get("error", {}).get("message") or r.text
        except ValueError:
            msg = r.text
        _fail(f"{r.status_code}: {msg}")
    return r.json() if r.content else None


@study_app.command("create")
def study_create(
    file: Annotated[Path, typer.Option("-f", "--file", help="spec as YAML or JSON")],
    api_url: ApiUrl = "http://127.0.0.1:8000",
    token: Token = None,
) -> None:
    """Create a study from a spec file."""
    import yaml

    try:
        data = yaml.safe_load(file.read_text())
    except OSError as e:
        _fail(f"cannot read {file}: {e.strerror}")
    except yaml.YAMLError as e:
        _fail(f"{file} is not valid YAML/JSON: {e}")
    out = _call("POST", "/v1/studies", api_url, token, data)
    typer.echo(f"created study {out['name']} ({out['state']})")


@study_app.command("list")
def study_list(api_url: ApiUrl = "http://127.0.0.1:8000", token: Token = None) -> None:
    """Every study with its state and trial counts."""
    from api.report.tables import table

    rows = []
    for st in _call("GET", "/v1/studies", api_url, token):
        t = st["trials"]
        rows.append([st["name"], st["state"], st["model"], t.get("COMPLETE", 0), t.get("RUNNING", 0), t.get("FAIL", 0)])
    typer.echo(table(["study", "state", "model", "complete", "running", "failed"], rows))


@study_app.command("show")
def study_show(
    name: str,
    api_url: ApiUrl = "http://127.0.0.1:8000",
    token: Token = None,
    as_json: Annotated[bool, typer.Option("--json", help="the raw study document instead of tables")] = False,
) -> None:
    """The study, its best configuration, and a table of its trials with the key metrics."""
    from api.report.tables import failures_table, levels_table, study_summary, trials_table

    shown = _call("GET", f"/v1/studies/{name}", api_url, token)
    if as_json:
        typer.echo(json.dumps(shown, indent=2, default=str))
        return
    trials = _call("GET", f"/v1/studies/{name}/trials", api_url, token)
    typer.echo(study_summary(shown))
    typer.echo("")
    typer.echo(levels_table(shown))
    typer.echo("")
    typer.echo(trials_table(shown, trials))
    failures = failures_table(trials)
    if failures:
        typer.echo("")
        typer.echo(failures)


@study_app.command("watch")
def study_watch(
    name: str,
    api_url: ApiUrl = "http://127.0.0.1:8000",
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
        shown = _call("GET", f"/v1/studies/{name}", api_url, token)
        line = progress_line(shown)
        if line != last:
            typer.echo(f"{time.strftime('%H:%M:%S', time.gmtime())}  {line}")
            last = line
        if shown["state"] != "running":
            typer.echo(shown["verdict"])
            if shown.get("cost"):
                typer.echo(f"cost: {shown['cost']['summary']}")
            if shown.get("deployment"):
                typer.echo(shown["deployment"]["launch_command"])
            return
        if time.monotonic() + interval > deadline:
            typer.secho(f"study {name} is still running after {timeout:.0f} s", err=True, fg=typer.colors.YELLOW)
            raise typer.Exit(1)
        time.sleep(interval)


@study_app.command("stop")
def study_stop(name: str, api_url: ApiUrl = "http://127.0.0.1:8000", token: Token = None) -> None:
    """Hand out no more trials (leases in flight may still report); `resume` undoes it."""
    out = _call("POST", f"/v1/studies/{name}/stop", api_url, token)
    typer.echo(f"study {name} is {out['state']}")


@study_app.command("resume")
def study_resume(name: str, api_url: ApiUrl = "http://127.0.0.1:8000", token: Token = None) -> None:
    """Hand out trials again to a stopped study, with the budget it has left."""
    out = _call("POST", f"/v1/studies/{name}/resume", api_url, token)
    typer.echo(f"study {name} is {out['state']}")


@study_app.command("export")
def study_export(
    name: str,
    api_url: ApiUrl = "http://127.0.0.1:8000",
    token: Token = None,
    fmt: Annotated[str, typer.Option("--format", help="csv: a row per trial and level; json: every document")] = "csv",
    output: Annotated[Path | None, typer.Option("-o", "--output", help="write here instead of stdout")] = None,
) -> None:
    """Every trial at every concurrency level, with its baseline, as CSV or JSON."""
    from api.report.export import to_csv, to_json

    if fmt not in ("csv", "json"):
        _fail(f"unknown --format {fmt!r}; choose csv or json")
    shown = _call("GET", f"/v1/studies/{name}", api_url, token)
    trials = _call("GET", f"/v1/studies/{name}/trials", api_url, token)
    text = to_csv(name, trials) if fmt == "csv" else to_json(shown, trials) + "\n"
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as e:
        _fail(f"cannot write {output}: {e.strerror}")
    typer.echo(f"wrote {output} ({len(trials)} trials)", err=True)


def _parse_config(text: str) -> dict[str, int]:
    parts = text.split("/")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        _fail(f"--config {text!r}: write steps/topk/draft_tokens, e.g. 3/1/4 or 5/4/8")
    steps, topk, tokens = (int(p) for p in parts)
    return {"num_steps": steps, "topk": topk, "num_draft_tokens": tokens}


def bench_spec(base: dict[str, Any], configs: list[dict[str, int]]) -> dict[str, Any]:
    """A study that measures exactly `configs` (sampler `list`): no search, no pruning, no confirmation."""
    from optimizer.space import SpecConfig

    canon = [SpecConfig.model_validate(c).canonical() for c in configs]
    trees = [c for c in canon if c.topk > 1]
    space: dict[str, Any] = {
        "num_steps": {"low": min(c.num_steps for c in canon), "high": max(c.num_steps for c in canon)},
        "topk": sorted({c.topk for c in canon}),
    }
    if trees:
        space["num_draft_tokens"] = {
            "low": min(c.num_draft_tokens for c in trees),
            "high": max(c.num_draft_tokens for c in trees),
        }
    unique = list({c.key: c.model_dump(mode="json", exclude_none=True) for c in canon}.values())
    return base | {
        "search_space": space,
        "warm_start": unique,
        "sampler": "list",
        "budget": {"max_trials": len(unique)},
        "confirmation": {"top": 0},
    }


@app.command()
def bench(
    config: Annotated[
        list[str], typer.Option("--config", "-c", help="steps/topk/draft_tokens to measure; repeat the option")
    ],
    file: Annotated[
        Path | None, typer.Option("-f", "--file", help="a spec (YAML/JSON) for model, workload, placement, serving")
    ] = None,
    name: Annotated[str | None, typer.Option(help="study name [default: the spec's, else bench-<time>]")] = None,
    target: Annotated[str | None, typer.Option(help="target model's registry name (without -f)")] = None,
    draft: Annotated[str | None, typer.Option(help="draft model's registry name (without -f)")] = None,
    concurrency: Annotated[str | None, typer.Option(help="levels to measure, e.g. 1,4,16")] = None,
    wait: Annotated[bool, typer.Option(help="follow it until done, then print the per-level table")] = False,
    api_url: ApiUrl = "http://127.0.0.1:8000",
    token: Token = None,
) -> None:
    """Benchmark given configurations against the baseline, without a search (bench_speculative's use).

    Creates a study with sampler `list`: the workers measure the baseline and each configuration
    once at every level (no pruning, no confirmation).  Read it with `study show` / `study export`.
    """
    import time

    import yaml

    base: dict[str, Any] = {}
    if file is not None:
        try:
            base = yaml.safe_load(file.read_text()) or {}
        except OSError as e:
            _fail(f"cannot read {file}: {e.strerror}")
        except yaml.YAMLError as e:
            _fail(f"{file} is not valid YAML/JSON: {e}")
        if not isinstance(base, dict):
            _fail(f"{file} does not hold a spec (a mapping)")
    elif not (target and draft):
        _fail("give -f SPEC, or --target and --draft (registry names)")
    if target or draft:
        base["model"] = {**(base.get("model") or {}), **({"target": target} if target else {})}
        if draft:
            base["model"]["draft"] = draft
    if concurrency:
        try:
            levels = [int(x) for x in concurrency.split(",") if x.strip()]
        except ValueError:
            _fail(f"--concurrency {concurrency!r}: write integers separated by commas, e.g. 1,4,16")
        base["workload"] = {**(base.get("workload") or {}), "concurrency": levels}
    base["name"] = name or base.get("name") or time.strftime("bench-%Y%m%d-%H%M%S", time.gmtime())
    try:
        spec = bench_spec(base, [_parse_config(c) for c in config])
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        _fail(f"--config: {e}")
    out = _call("POST", "/v1/studies", api_url, token, spec)
    typer.echo(f"created study {out['name']}: {len(spec['warm_start'])} configurations and the baseline")
    if not wait:
        typer.echo(f"follow it with: spectune study watch {out['name']}; then spectune study show {out['name']}")
        return
    study_watch(out["name"], api_url=api_url, token=token)
    from api.report.tables import levels_table, trials_table

    shown = _call("GET", f"/v1/studies/{out['name']}", api_url, token)
    trials = _call("GET", f"/v1/studies/{out['name']}/trials", api_url, token)
    typer.echo(levels_table(shown))
    typer.echo(trials_table(shown, trials))


# `spectune study best` exits with this status when the verdict is "speculation does not pay here"
# (it then prints the command without speculation); 2 stays "an error".
EXIT_NO_SPECULATION = 3


@study_app.command("best")
def study_best(
    name: str,
    api_url: ApiUrl = "http://127.0.0.1:8000",
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

    Exit status 0: speculation pays and the command runs it; 3: speculation does not pay here and
    the command runs the same server without it; 2: an error (e.g. nothing measured yet).
    """
    from optimizer.deploy import Deployment

    if fmt not in ("sglang", "json"):
        _fail(f"unknown --format {fmt!r}; choose sglang or json")
    models: dict[str, str] = {}
    if worker_config is not None:
        from workers.config import read_model_registry
        from workers.errors import ConfigError

        try:
            models = read_model_registry(worker_config)
        except ConfigError as e:
            _fail(str(e))
    shown = _call("GET", f"/v1/studies/{name}", api_url, token)
    doc = shown.get("deployment")
    if shown.get("best") is None or doc is None:
        _fail(f"study {name} has no measured configuration yet (state {shown['state']}); try again later")
    deployment = Deployment.from_json(doc)
    missing = [m for m in (deployment.settings.target, deployment.settings.draft) if m and models and m not in models]
    if missing:
        _fail(f"{worker_config} has no [models] entry for {', '.join(missing)}")
    command = deployment.command(models=models, host=host, port=port)
    if fmt == "sglang":
        typer.echo(command)
        if not deployment.speculation:
            typer.echo(f"# {shown['verdict']}", err=True)
    else:
        out = {
            "study": name,
            "state": shown["state"],
            "verdict": shown["verdict"],
            "speculation_pays": shown.get("speculation_pays"),
            "winner": shown.get("winner"),
            "deployment": doc | {"launch_command": command},
        }
        typer.echo(json.dumps(out, indent=2))
    if not deployment.speculation:
        raise typer.Exit(EXIT_NO_SPECULATION)


@app.command()
def report(
    name: str,
    output: Annotated[Path, typer.Option("-o", "--output", help="the HTML file to write")] = Path("report.html"),
    database_url: Annotated[
        str | None,
        typer.Option("--database-url", envvar="SPECTUNE_DATABASE_URL", help="read the database directly"),
    ] = None,
    api_url: ApiUrl = "http://127.0.0.1:8000",
    token: Token = None,
    plots_dir: Annotated[Path | None, typer.Option(help="also write each plot as a PNG file here")] = None,
) -> None:
    """Write one self-contained HTML report (plots embedded) explaining a study.

    Reads the database directly with --database-url (or SPECTUNE_DATABASE_URL); otherwise asks
    the API with a token.
    """
    from api.report import ReportSourceError, build_report, load_from_api, load_from_database

    _ensure_utc()
    try:
        if database_url:
            typer.echo(f"reading study {name} from the database", err=True)
            data = load_from_database(database_url, name)
        else:
            typer.echo(f"reading study {name} from {api_url}", err=True)
            with _client(api_url, token) as client:
                data = load_from_api(client, name)
    except ReportSourceError as e:
        _fail(str(e))
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
        _fail(f"cannot write the report: {e}")
    typer.echo(f"wrote {output} ({len(rendered.plots)} plots, {len(rendered.html) // 1024} KiB)")


def main() -> None:
    try:
        app()
    except CliError as e:
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - a bug still gets one line; the traceback on request
        if os.environ.get("SPECTUNE_DEBUG"):
            raise
        typer.secho(f"error: {type(e).__name__}: {e} (set SPECTUNE_DEBUG=1 for the traceback)", err=True, fg="red")
        sys.exit(2)


if __name__ == "__main__":
    main()
