"""What every `spectune` command shares: the options naming the database and the API, the one-line
error exit (status 2), UTC, and the HTTP call to the API that turns its errors into that exit."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from spectune_protocol.printable import printable

DbUrl = Annotated[
    str | None,
    typer.Option("--database-url", envvar="SPECTUNE_DATABASE_URL", help="default: sqlite:///./spectune.db"),
]
ApiUrl = Annotated[str, typer.Option("--api-url", envvar="SPECTUNE_API_URL")]
Token = Annotated[str | None, typer.Option("--token", envvar="SPECTUNE_TOKEN", help="bearer token (or SPECTUNE_TOKEN)")]
DEFAULT_API_URL = "http://127.0.0.1:8000"


def fail(message: str) -> NoReturn:
    """Print `error: message` in red and exit with status 2 (an error the user can fix)."""
    typer.secho(f"error: {printable(message, keep_newlines=True)}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


def read_yaml(file: Path) -> Any:
    """A spec file's data (YAML or JSON); a one-line error when it cannot be read or parsed."""
    import yaml

    try:
        return yaml.safe_load(file.read_text())
    except OSError as e:
        fail(f"cannot read {file}: {e.strerror}")
    except yaml.YAMLError as e:
        fail(f"{file} is not valid YAML/JSON: {e}")


def say(text: str) -> None:
    """Print text that holds what others stored (study names, failure messages a worker sent):
    control characters are shown as escapes, so an escape sequence cannot rewrite the terminal."""
    typer.echo(printable(text, keep_newlines=True))


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("spectune")
    except PackageNotFoundError:  # run from a source tree without an install
        return "unknown (not installed)"


def settings(database_url: str | None) -> Any:
    from api.settings import Settings

    return Settings(database_url=database_url) if database_url else Settings()


def ensure_utc() -> None:
    # Optuna stores naive UTC timestamps; run everything in UTC (docs/optuna.md §1).
    os.environ["TZ"] = "UTC"
    if hasattr(time, "tzset"):  # not on Windows
        time.tzset()


def client(api_url: str, token: str | None) -> Any:
    """An httpx client for the API with the bearer token; no token is an error the user can fix."""
    import httpx

    if not token:
        fail("no token: pass --token or set SPECTUNE_TOKEN (create one with `spectune token create --role user`)")
    return httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30.0)


def call(method: str, path: str, api_url: str, token: str | None, body: Any = None) -> Any:
    """One API request; an unreachable API or a 4xx/5xx becomes a one-line error (exit 2)."""
    import httpx

    with client(api_url, token) as c:
        try:
            r = c.request(method, path, json=body)
        except httpx.HTTPError as e:
            fail(f"cannot reach the API at {api_url}: {e}")
    if r.status_code >= 400:
        try:
            msg = r.json().get("error", {}).get("message") or r.text
        except ValueError:
            msg = r.text
        fail(f"{r.status_code}: {msg}")
    return r.json() if r.content else None
