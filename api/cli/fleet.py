"""`spectune workers`: the fleet from the command line (talks to the API, GET/POST /v1/workers).

`list` shows each worker's health (ok, quarantined, silent), the SGLang version it runs, its
GPUs, the lease it holds and the studies it refused; `release` lifts a quarantine and
`clear-refusals` ends a worker's refusals (both admin).  Refusals also end by themselves when a
worker restarts with a changed allowlist, registry or prompt folder (its config digest).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from api.cli.common import DEFAULT_API_URL, ApiUrl, Token, call

workers_app = typer.Typer(no_args_is_help=True, help="The fleet of workers (talks to the API).")

_MAX_CELL = 60


def _cut(text: str, width: int = _MAX_CELL) -> str:
    """Shorten at a word boundary, marked with an ellipsis (never mid-word)."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    cut = text[: width - 1].rsplit(" ", 1)[0]
    return (cut or text[: width - 1]) + "…"


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _gpus(inventory: dict[str, Any]) -> str:
    gpus = inventory.get("gpus") or []
    if not gpus:
        return "none seen"
    names = sorted({str(g.get("name")) for g in gpus})
    return f"{len(gpus)}x {names[0] if len(names) == 1 else 'mixed'}"


def _lease(lease: dict[str, Any] | None) -> str:
    if lease is None:
        return "—"
    trial = "" if lease.get("trial_number") is None else f" trial {lease['trial_number']}"
    return f"{lease['study']} {lease['kind']}{trial}"


def render_workers(workers: list[dict[str, Any]]) -> str:
    """The table `spectune workers list` prints, then one line per refusal and quarantine."""
    if not workers:
        return "no worker has asked for work yet"
    header = ("worker", "health", "last seen", "SGLang", "GPUs", "current lease", "refusals")
    rows = [
        (
            w["id"],
            w["health"],
            _ago(float(w["seconds_since_seen"])),
            str(w.get("sglang_version") or "?"),
            _gpus(w.get("inventory") or {}),
            _lease(w.get("current_lease")),
            str(len(w.get("refusals") or [])),
        )
        for w in workers
    ]
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in (header, *rows)]
    for w in workers:
        if w.get("quarantine_reason"):
            lines.append(f"{w['id']}: quarantined: {_cut(w['quarantine_reason'], 200)}")
        for r in w.get("refusals") or []:
            lines.append(f"{w['id']}: refused study {r['study']}: {_cut(r['message'], 200)}")
    return "\n".join(lines)


@workers_app.command("list")
def workers_list(
    as_json: Annotated[bool, typer.Option("--json", help="print the API's documents")] = False,
    api_url: ApiUrl = DEFAULT_API_URL,
    token: Token = None,
) -> None:
    """Every worker: health, last seen, SGLang version, GPUs, current lease, refusals."""
    workers = call("GET", "/v1/workers", api_url, token)
    typer.echo(json.dumps(workers, indent=2) if as_json else render_workers(workers))


@workers_app.command("release")
def workers_release(worker_id: str, api_url: ApiUrl = DEFAULT_API_URL, token: Token = None) -> None:
    """Lift a worker's quarantine after the host was fixed (admin token)."""
    call("POST", f"/v1/workers/{worker_id}/release", api_url, token)
    typer.echo(f"{worker_id}: released; it gets work on its next lease request")


@workers_app.command("clear-refusals")
def workers_clear_refusals(worker_id: str, api_url: ApiUrl = DEFAULT_API_URL, token: Token = None) -> None:
    """Offer a worker the studies it refused again (admin token).

    Not needed after a change of its allowlist, registry or prompt files: a worker restarted with
    a changed config ends its refusals by itself.
    """
    cleared = call("POST", f"/v1/workers/{worker_id}/refusals/clear", api_url, token)["cleared"]
    typer.echo(f"{worker_id}: {cleared} refusal(s) cleared")
