"""`spectune report`: a finished simulated study becomes one self-contained HTML file with plots.

The study runs through the real API (leases, baselines, completes) with reports whose numbers
come from the simulated engine's calibrated model (spectune_sim/model.py), so the plots
show the shapes a real study shows.  `run_simulated_study` is shared with the dashboard and CLI
tests.
"""

from __future__ import annotations

import base64
import random
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from fastapi.testclient import TestClient

from tests.support.api_client import make_settings, make_tokens
from tests.support.specs import INVENTORY, small_spec

LANDSCAPE = "moe-pcie"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def report_spec(name: str, *, max_trials: int = 10, concurrency: tuple[int, ...] = (1, 4)) -> dict[str, Any]:
    return small_spec(
        name,
        workload={
            "output_len": 64,
            "num_prompts": 8,
            "concurrency": list(concurrency),
            "repeats": 3,
            "warmup_requests": 1,
        },
        budget={"max_trials": max_trials},
        # TPE, seeded: the plots need a spread of chains and trees, whatever `auto` picks.
        sampler="tpe",
    )


def _level(pred: Any, concurrency: int, rng: random.Random) -> dict[str, Any]:
    runs = [pred.output_tok_s * rng.uniform(0.985, 1.015) for _ in range(3)]
    itl = 1000.0 / pred.per_user_tok_s
    return {
        "concurrency": concurrency,
        "output_tok_s": sum(runs) / len(runs),
        "output_tok_s_runs": runs,
        "per_user_tok_s": pred.per_user_tok_s,
        "accept_length": pred.accept_length,
        "itl_ms_p50": itl,
        "itl_ms_p99": itl * 1.6,
        "ttft_ms_p50": 40.0,
        "ttft_ms_p99": 75.0,
    }


def simulated_report(config: dict[str, Any] | None, concurrency: list[int], rng: random.Random) -> dict[str, Any]:
    """A complete report as a worker would send it, from the simulator's model of `moe-pcie`."""
    from optimizer.space import SpecConfig
    from spectune_sim.landscapes import get_landscape
    from spectune_sim.model import InfeasibleConfigError, predict, startup_seconds

    landscape = get_landscape(LANDSCAPE)
    spec = None if config is None else SpecConfig.model_validate(config)
    if spec is not None and spec.num_draft_tokens >= 10:
        # The test landscape's GPU memory is made tight on purpose: wide trees do not fit.
        tail = "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (capturing cuda graph)\n"
        return {"outcome": "failed", "failure": {"kind": "oom", "message": "CUDA out of memory", "log_tail": tail}}
    try:
        levels = [_level(predict(landscape, spec, c), c, rng) for c in concurrency]
    except InfeasibleConfigError as e:
        return {"outcome": "failed", "failure": {"kind": "invalid_config", "message": str(e), "log_tail": ""}}
    startup = startup_seconds(landscape, spec)
    effective = {} if spec is None else {"speculative_num_steps": spec.num_steps, "speculative_eagle_topk": spec.topk}
    return {
        "outcome": "ok",
        "metrics": {
            "levels": levels,
            "startup_s": startup,
            "effective": effective,
            "sglang_version": "0.5.23",
            "log_tail": "[sim] server log\n",
        },
    }


def run_simulated_study(
    client: httpx.Client,
    tokens: dict[str, str],
    spec: dict[str, Any],
    *,
    before_complete: Callable[[str, int, dict[str, Any]], None] | None = None,
    max_leases: int = 60,
) -> dict[str, Any]:
    """Drive a study to its budget through the real lease API; returns the finished study.

    `before_complete(study, trial_number, report)` runs while the trial is still RUNNING (the
    place where artifacts are uploaded).
    """
    headers = {role: {"Authorization": f"Bearer {tok}"} for role, tok in tokens.items()}
    r = client.post("/v1/studies", headers=headers["user"], json=spec)
    assert r.status_code == 201, r.text
    rng = random.Random(11)
    for _ in range(max_leases):  # bounded: the budget ends the study well before this
        r = client.post("/v1/workers/sim-1/lease", headers=headers["worker"], json=INVENTORY)
        if r.status_code == 204:
            break
        assert r.status_code == 200, r.text
        lease = r.json()
        # The lease's own levels: it may come from another running study (the API checks them).
        report = simulated_report(lease["config"], lease["workload"]["concurrency"], rng)
        if lease["kind"] == "trial" and before_complete is not None:
            before_complete(spec["name"], lease["trial_number"], report)
        r = client.post(f"/v1/leases/{lease['lease_id']}/complete", headers=headers["worker"], json=report)
        assert r.status_code == 200, r.text
    shown = client.get(f"/v1/studies/{spec['name']}", headers=headers["user"]).json()
    assert shown["state"] == "finished", shown
    return dict(shown)


def _images(html_text: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html_text)]


def test_report_from_the_database_embeds_every_plot(tmp_path: Path, sqlite_template: Path) -> None:
    import shutil

    from api.app import create_app

    db = tmp_path / "spectune.db"
    shutil.copy(sqlite_template, db)
    url = f"sqlite:///{db}"
    tokens = make_tokens(url)
    with TestClient(create_app(make_settings(url))) as client:
        shown = run_simulated_study(client, tokens, report_spec("rep"))
    assert shown["best"] is not None

    out = tmp_path / "out" / "report.html"
    plots_dir = tmp_path / "plots"
    r = subprocess.run(
        [sys.executable, "-m", "api.cli", "report", "rep", "-o", str(out), "--database-url", url,
         "--plots-dir", str(plots_dir)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    images = _images(text)
    # speedup at 1 and at 4, acceptance, cycle split, history, concurrency (two levels), start-up,
    # per-user against per-GPU throughput, failures (OOM)
    assert len(images) == 9, len(images)
    for img in images:
        assert img.startswith(PNG_MAGIC) and len(img) > 10_000
    for anchor in (
        "plot-speedup",
        "plot-acceptance",
        "plot-cycle",
        "plot-concurrency",
        "plot-startup",
        "plot-failures",
        "plot-tradeoff",
    ):
        assert f'id="{anchor}"' in text
    # Self-contained: nothing is fetched when the file is opened.
    assert not re.search(r'(src|href)="(https?:)?//', text)
    assert "<script" not in text
    # The winner with its interval and exact launch command.
    assert "95% interval" in text
    assert "--speculative-num-steps" in text and shown["best"]["launch_command"].split()[0] in text
    assert shown["verdict"] in text
    assert "oom" in text  # the failed configurations are listed
    # Trees and chains were both measured, so the cycle split is a fit, close to the model's.
    from api.report import analysis, load_from_database

    data = load_from_database(url, "rep")
    fit = analysis.fit_cycle(analysis.points(data.trials, 1))
    assert fit is not None and fit.draft_step_ms > 0 and fit.r2 > 0.8
    assert sorted(p.name for p in plots_dir.iterdir()) == sorted(
        f"{n}.png"
        for n in (
            "speedup",
            "speedup-c4",
            "acceptance",
            "cycle",
            "history",
            "concurrency",
            "startup",
            "tradeoff",
            "failures",
        )
    )
    # Every plot says which level it draws; the caption about levels comes from the study's own data.
    assert "Speedup at concurrency 1 against steps" in text and "Speedup at concurrency 4 against steps" in text
    assert "the lowest level; the objective is the geometric mean over 1, 4" in text
    assert "shrinks as concurrency grows" not in text
    assert "The best configuration" in text
    assert f"Workload measured: {shown['workload']}" in text


def test_report_through_the_api_and_clear_errors(api: Any, tmp_path: Path) -> None:
    run_simulated_study(api.client, api.tokens, report_spec("via-api", max_trials=6, concurrency=(1,)))

    from api.report import build_report, load_from_api

    api.client.headers["Authorization"] = f"Bearer {api.tokens['user']}"
    data = load_from_api(api.client, "via-api")
    rendered = build_report(data)
    names = [p.name for p in rendered.plots]
    assert "concurrency" not in names  # one level only: no speedup-vs-concurrency plot
    assert {"speedup", "acceptance", "cycle", "history", "startup"} <= set(names)
    assert len(_images(rendered.html)) == len(rendered.plots)

    from api.report import ReportSourceError

    try:
        load_from_api(api.client, "no-such-study")
    except ReportSourceError as e:
        assert str(e).startswith("404")
    else:  # pragma: no cover
        raise AssertionError("a missing study must raise ReportSourceError")


def test_report_cli_errors_are_one_line(tmp_path: Path, sqlite_template: Path) -> None:
    import shutil

    db = tmp_path / "spectune.db"
    shutil.copy(sqlite_template, db)
    r = subprocess.run(
        [sys.executable, "-m", "api.cli", "report", "nope", "-o", str(tmp_path / "r.html"),
         "--database-url", f"sqlite:///{db}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    assert "no study named 'nope'" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "api.cli", "report", "x", "--api-url", "http://127.0.0.1:9", "--token", "st_x"],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "TZ": "UTC"},
    )  # fmt: skip
    assert r.returncode == 2 and "cannot reach the API" in r.stderr and "Traceback" not in r.stderr
