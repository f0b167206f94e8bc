"""`spectune study plan SPEC`: what a study will likely cost, before its first launch (api.estimate)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from api.cli.client import study_app
from api.cli.common import DEFAULT_API_URL, ApiUrl, Token, call, fail, read_yaml, say
from api.estimate import DEFAULT_DRAWS, estimate
from optimizer.errors import SpecError
from optimizer.spec import StudySpec, parse_spec


def read_spec(file: Path) -> StudySpec:
    """The spec file, validated as `POST /v1/studies` validates it; a one-line error otherwise."""
    data = read_yaml(file)
    try:
        return parse_spec(data)
    except SpecError as e:
        fail(f"{file}: {e}")
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        fail(f"{file} is not a valid study spec: {e}")


def eligible_workers(spec: StudySpec, fleet: list[dict[str, Any]]) -> int:
    """Workers of `GET /v1/workers` that could take the study: not quarantined, requirements met."""
    from api.services.eligibility import requirements_unmet

    return sum(1 for w in fleet if not w.get("quarantined") and not requirements_unmet(spec, w.get("inventory") or {}))


@study_app.command("plan")
def study_plan(
    file: Annotated[Path, typer.Argument(help="spec as YAML or JSON (what `study create -f` takes)")],
    workers: Annotated[
        int | None,
        typer.Option("--workers", min=1, max=64, help="fleet size; default: the API's workers eligible for the spec"),
    ] = None,
    draws: Annotated[
        int, typer.Option("--draws", min=1, max=200, help="rehearsals (engines drawn from the prior)")
    ] = DEFAULT_DRAWS,
    seed: Annotated[int, typer.Option("--seed", help="draws of the same seed repeat")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="the estimate as JSON")] = False,
    api_url: ApiUrl = DEFAULT_API_URL,
    token: Token = None,
) -> None:
    """Expected launches, GPU-hours and wall time of a study, with an 80% range, before any GPU is used.

    The study's own decision procedure is rehearsed on engines drawn from the prior for the spec's
    class (tensor-parallel size), at the fleet the study would run on.
    """
    from workers.lifeline import exit_with_parent

    exit_with_parent()  # the API's child for a study's estimate stops when the API does
    spec = read_spec(file)
    if workers is None:
        fleet = call("GET", "/v1/workers", api_url, token)
        workers = eligible_workers(spec, fleet)
        if workers == 0:
            fail(
                f"no registered worker can take {spec.name} (models {spec.model.target}/{spec.model.draft}, "
                f"tp {spec.model.tp_size}, placement {spec.placement or 'any'}); "
                "pass --workers N to plan for a fleet of N"
            )
    got = estimate(spec, workers, draws=draws, seed=seed)
    say(got.model_dump_json(indent=2) if as_json else "\n".join(got.lines()))
