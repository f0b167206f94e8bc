"""The `spectune` command line: server, worker, demo, study, db, token.

Errors a user can fix are printed as one line (no traceback) and exit with status 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Tune SGLang EAGLE-3 speculative decoding.")
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


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


def _settings(database_url: str | None) -> Any:
    from api.settings import Settings

    return Settings(database_url=database_url) if database_url else Settings()


def _ensure_utc() -> None:
    # Optuna stores naive UTC timestamps; run everything in UTC (reference/optuna.md §1).
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
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info")


@app.command()
def worker(config: Annotated[Path, typer.Option("--config", "-c", help="worker TOML file")]) -> None:
    """Run the GPU-host agent: lease, launch SGLang, benchmark, report."""
    _ensure_utc()
    try:
        from workers.agent import main as worker_main
    except ImportError as e:  # pragma: no cover - packaging problem
        _fail(f"the worker is not available in this installation: {e}")
    raise typer.Exit(worker_main(config))


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option(help="where the demo keeps its database and logs")] = Path("./spectune-demo"),
    landscape: Annotated[str, typer.Option(help="simulated engine landscape")] = "moe-pcie",
    trials: Annotated[int, typer.Option(help="max trials")] = 20,
) -> None:
    """Run a whole study on the embedded default: SQLite, the API, two simulated workers."""
    _ensure_utc()
    try:
        from api.demo import run_demo
    except ImportError as e:
        _fail(f"the demo is not available in this installation: {e}")
    raise typer.Exit(run_demo(workdir=workdir, landscape=landscape, max_trials=trials))


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
    typer.echo(token)


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[int, typer.Argument(help="id from `spectune token list`")], database_url: DbUrl = None
) -> None:
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
    for st in _call("GET", "/v1/studies", api_url, token):
        t = st["trials"]
        typer.echo(
            f"{st['name']}\t{st['state']}\t{st['model']}\tcomplete={t.get('COMPLETE', 0)} running={t.get('RUNNING', 0)}"
        )


@study_app.command("show")
def study_show(name: str, api_url: ApiUrl = "http://127.0.0.1:8000", token: Token = None) -> None:
    typer.echo(json.dumps(_call("GET", f"/v1/studies/{name}", api_url, token), indent=2, default=str))


def main() -> None:
    try:
        app()
    except CliError as e:
        typer.secho(f"error: {e}", err=True, fg=typer.colors.RED)
        sys.exit(2)


if __name__ == "__main__":
    main()
