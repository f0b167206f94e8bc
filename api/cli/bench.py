"""`spectune bench`: measure given configurations against the baseline, without a search."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from api.cli.client import get_study, get_trials, study_watch
from api.cli.common import DEFAULT_API_URL, ApiUrl, Token, call, fail
from api.documents import StudyDocument


def parse_config(text: str) -> dict[str, int]:
    """`steps/topk/draft_tokens` (e.g. 3/1/4) as a configuration mapping; anything else exits 2."""
    parts = text.split("/")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        fail(f"--config {text!r}: write steps/topk/draft_tokens, e.g. 3/1/4 or 5/4/8")
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


def _read_base(file: Path) -> dict[str, Any]:
    import yaml

    try:
        base = yaml.safe_load(file.read_text()) or {}
    except OSError as e:
        fail(f"cannot read {file}: {e.strerror}")
    except yaml.YAMLError as e:
        fail(f"{file} is not valid YAML/JSON: {e}")
    if not isinstance(base, dict):
        fail(f"{file} does not hold a spec (a mapping)")
    return base


def bench(
    config: Annotated[
        list[str], typer.Option("--config", "-c", help="steps/topk/draft_tokens to measure; repeat the option")
    ],
    file: Annotated[
        Path | None, typer.Option("-f", "--file", help="a spec (YAML/JSON) for model, workload, placement, serving")
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            help="study name [default: <the spec's name>-bench-<UTC time> with -f (the spec's own name is "
            "usually its search study's), else bench-<UTC time>]"
        ),
    ] = None,
    target: Annotated[str | None, typer.Option(help="target model's registry name (without -f)")] = None,
    draft: Annotated[str | None, typer.Option(help="draft model's registry name (without -f)")] = None,
    tp_size: Annotated[
        int | None, typer.Option("--tp-size", min=1, max=64, help="tensor parallelism (GPUs per server); default 1")
    ] = None,
    concurrency: Annotated[str | None, typer.Option(help="levels to measure, e.g. 1,4,16")] = None,
    wait: Annotated[bool, typer.Option(help="follow it until done, then print the per-level table")] = False,
    api_url: ApiUrl = DEFAULT_API_URL,
    token: Token = None,
) -> None:
    """Benchmark given configurations against the baseline, without a search (bench_speculative's use).

    Creates a study with sampler `list`: the workers measure the baseline and each configuration
    once at every level (no pruning, no confirmation).  Read it with `study show` / `study export`.
    """
    base: dict[str, Any] = {}
    if file is not None:
        base = _read_base(file)
    elif not (target and draft):
        fail("give -f SPEC, or --target and --draft (registry names)")
    if target or draft or tp_size:
        base["model"] = {**(base.get("model") or {}), **({"target": target} if target else {})}
        if draft:
            base["model"]["draft"] = draft
        if tp_size:
            base["model"]["tp_size"] = tp_size
    if concurrency:
        try:
            levels = [int(x) for x in concurrency.split(",") if x.strip()]
        except ValueError:
            fail(f"--concurrency {concurrency!r}: write integers separated by commas, e.g. 1,4,16")
        base["workload"] = {**(base.get("workload") or {}), "concurrency": levels}
    stamp = time.strftime("bench-%Y%m%d-%H%M%S", time.gmtime())
    # Not the spec's own name: `study create -f spec.yaml` took it for the search (409 otherwise).
    spec_name = str(base.get("name") or "")[:40].rstrip("-")
    base["name"] = name or (f"{spec_name}-{stamp}" if spec_name else stamp)
    try:
        spec = bench_spec(base, [parse_config(c) for c in config])
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        fail(f"--config: {e}")
    created = StudyDocument.model_validate(call("POST", "/v1/studies", api_url, token, spec))
    typer.echo(f"created study {created.name}: {len(spec['warm_start'])} configurations and the baseline")
    if not wait:
        typer.echo(f"follow it with: spectune study watch {created.name}; then spectune study show {created.name}")
        return
    study_watch(created.name, api_url=api_url, token=token)
    from api.report.tables import levels_table, trials_table

    shown = get_study(created.name, api_url, token)
    trials = get_trials(created.name, api_url, token)
    typer.echo(levels_table(shown))
    typer.echo(trials_table(shown, trials))
