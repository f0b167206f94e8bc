"""Operator commands: run the API, a worker or the demo; the database schema; API tokens.

These talk to the database directly (no token needed), so they run where the server runs.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated

import typer

from api.cli.common import DbUrl, ensure_utc, fail, settings
from workers.lifeline import ENV as LIFELINE_ENV
from workers.lifeline import exit_with_parent

db_app = typer.Typer(no_args_is_help=True, help="Database schema.")
token_app = typer.Typer(no_args_is_help=True, help="API tokens (talks to the database directly).")


def server(
    database_url: DbUrl = None,
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to bind")] = 8000,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            max=64,
            help="API processes on the one port (Postgres only; one per core: a process is one core's worth)",
        ),
    ] = 1,
) -> None:
    """Run the API (uvicorn).  Refuses to start on an old schema."""
    import uvicorn

    from api.app import create_app, freeze_startup_heap
    from api.db import is_sqlite, make_engine
    from api.errors import SchemaOutdatedError
    from api.schema import check_current

    ensure_utc()
    config = settings(database_url)
    engine = make_engine(config.database_url)
    try:
        check_current(engine)
    except SchemaOutdatedError as e:
        fail(e.message)
    except Exception as e:  # noqa: BLE001 - e.g. the database is unreachable
        fail(f"cannot open the database {engine.url.render_as_string(hide_password=True)}: {e}")
    finally:
        engine.dispose()
    if workers > 1 and is_sqlite(config.database_url):
        fail(f"--workers {workers} needs Postgres: a SQLite file takes one writer at a time; run one process")
    exit_with_parent()
    if workers == 1:
        uvicorn.run(freeze_startup_heap(create_app(config)), host=host, port=port, log_level="info")
        return
    # One Python process spends most of its time holding the GIL under load (40 clients, 300
    # studies: 98% of a core), and /healthz waits behind its request threads for each turn of
    # the event loop.  More processes share the load; everything they share is in Postgres (the
    # study locks are advisory locks, the memos are per process and recomputed on a miss).  Each
    # process builds its app from the environment, so the URL goes there, and each stops when
    # this supervisor is gone (workers/lifeline.py watches its parent's pid).
    os.environ["SPECTUNE_DATABASE_URL"] = config.database_url
    os.environ[LIFELINE_ENV] = str(os.getpid())
    from uvicorn.supervisors import Multiprocess

    app = "api.app:create_app_in_worker"
    cfg = uvicorn.Config(app, factory=True, workers=workers, host=host, port=port, log_level="info")
    Multiprocess(cfg, sockets=[_listening_socket(host, port)]).run()


def _listening_socket(host: str, port: int) -> socket.socket:
    """The port the processes share, made here rather than by uvicorn: uvicorn's has protocol 0, the
    processes' copies too, and asyncio then leaves Nagle's algorithm on for every connection
    accepted from it (it sets TCP_NODELAY only on IPPROTO_TCP sockets).  A response's head and body
    go out as two writes, so the body waited for the client's delayed ACK: 44 ms per keep-alive
    request against 1 ms from one process."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        fail(f"cannot bind {host}:{port}: {e.strerror}")
    sock.set_inheritable(True)
    return sock


def worker(config: Annotated[Path, typer.Option("--config", "-c", help="worker TOML file")]) -> None:
    """Run the GPU-host agent: lease, launch SGLang, benchmark, report."""
    # The worker's own CLI (workers/cli.py): it also runs from a worker-only install, without api/.
    from workers.cli import main as worker_main

    raise typer.Exit(worker_main(["--config", str(config)]))


def demo(
    workdir: Annotated[Path, typer.Option(help="where the demo keeps its database and logs")] = Path("./spectune-demo"),
    landscape: Annotated[str, typer.Option(help="simulated engine landscape")] = "moe-pcie",
    trials: Annotated[int, typer.Option(help="max trials")] = 20,
    deadline_s: Annotated[
        float, typer.Option(help="stop the study after this many seconds and show what it found")
    ] = 280.0,
) -> None:
    """Run a whole study on the embedded default: SQLite, the API, two simulated workers."""
    ensure_utc()
    try:
        from api.demo import run_demo
    except ImportError as e:
        fail(f"the demo is not available in this installation: {e}")
    raise typer.Exit(run_demo(workdir=workdir, landscape=landscape, max_trials=trials, deadline_s=deadline_s))


@db_app.command("upgrade")
def db_upgrade(database_url: DbUrl = None) -> None:
    """Create or upgrade spectune's and Optuna's tables to head (run once per deploy)."""
    from api.schema import upgrade

    ensure_utc()
    config = settings(database_url)
    try:
        upgrade(config.database_url)
    except Exception as e:  # noqa: BLE001 - any failure here is reported as one line
        fail(f"upgrade failed: {e}")
    typer.echo("database schema is at head")


@db_app.command("repair-trial")
def db_repair_trial(
    study: Annotated[str, typer.Argument(help="the study's name")],
    number: Annotated[int, typer.Argument(help="the trial's number (`spectune study trials`)")],
    quarantine: Annotated[
        str | None,
        typer.Option(help="also quarantine the trial, with this reason (e.g. a forged measurement)"),
    ] = None,
    database_url: DbUrl = None,
) -> None:
    """Repair a trial whose stored record holds values that fail today's checks.

    Removes those values (the originals are kept in the event log) and quarantines the trial when
    its configuration or measurements were among them, or when --quarantine gives a reason: a
    quarantined trial reads as failed and is never a study's best.
    """
    from api.db import make_engine, make_sessionmaker
    from api.errors import ApiError
    from api.services.trial_records import repair_trial

    ensure_utc()
    engine = make_engine(settings(database_url).database_url)
    try:
        done = repair_trial(make_sessionmaker(engine), study, number, quarantine)
    except ApiError as e:
        fail(e.message)
    finally:
        engine.dispose()
    for line in done or ["nothing to repair: every stored value passes today's checks"]:
        typer.echo(f"trial {number} of {study}: {line}")


def _create_token_file(output: Path) -> int:
    """A new file for a token, mode 0600 from the start; never an existing file or a symlink.

    O_EXCL: writing into an existing file (or through a symlink an attacker planted, e.g. in a
    shared folder, pointing at a file of ours) would hand them the token or clobber the file.
    Opened before the token is created, so a refused path leaves no orphan token behind.
    """
    try:
        return os.open(output, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        kind = "a symlink" if output.is_symlink() else "a file"
        fail(f"{output} is {kind} that already exists; the token is written only to a new file: pass a new path")
    except OSError as e:
        fail(f"cannot create {output}: {e.strerror}")


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

    fd = None if output is None else _create_token_file(output)
    engine = make_engine(settings(database_url).database_url)
    try:
        _, token = create_token(make_sessionmaker(engine), role, name, worker_id)
    except BaseException as e:
        if fd is not None and output is not None:
            os.close(fd)
            output.unlink(missing_ok=True)  # the empty file this command created, nothing else
        if isinstance(e, ApiError):
            fail(e.message)
        if isinstance(e, Exception):
            fail(f"cannot create the token ({e}); did you run `spectune db upgrade`?")
        raise
    finally:
        engine.dispose()
    if fd is None:
        typer.echo(token)
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(token + "\n")
    except OSError as e:
        fail(f"cannot write the token to {output}: {e.strerror}")
    typer.echo(f"{role} token written to {output}")


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[int, typer.Argument(help="id from `spectune token list`")], database_url: DbUrl = None
) -> None:
    """Revoke a token: it (and any dashboard session made with it) stops working at once."""
    from api.auth import revoke_token
    from api.db import make_engine, make_sessionmaker
    from api.errors import ApiError

    engine = make_engine(settings(database_url).database_url)
    try:
        revoke_token(make_sessionmaker(engine), token_id)
    except ApiError as e:
        fail(e.message)
    finally:
        engine.dispose()
    typer.echo(f"token {token_id} revoked")


@token_app.command("list")
def token_list(database_url: DbUrl = None) -> None:
    """Every token: id, role, state, name and bound worker (never the token itself)."""
    from api.auth import list_tokens
    from api.db import make_engine, make_sessionmaker

    engine = make_engine(settings(database_url).database_url)
    try:
        typer.echo("id\trole\tstate\tname")  # tab-separated, for cut and awk
        for t in list_tokens(make_sessionmaker(engine)):
            state = "revoked" if t.revoked_at else "active"
            bound = f" worker={t.worker_id}" if t.worker_id else ""
            typer.echo(f"{t.id}\t{t.role}\t{state}\t{t.name}{bound}")
    finally:
        engine.dispose()
