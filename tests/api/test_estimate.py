"""An estimate before the first launch (issue 33 item 8): well-formed, and it moves the right way.

The estimate rehearses the study's own decision procedure on engines drawn from the prior
(api.estimate); whether its 80% range holds the launches real studies take is
benchmarks/plan_calibration.py's question (run by hand).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from typer.testing import CliRunner

from api.cli import app
from api.documents import Estimate
from api.estimate import estimate
from optimizer.spec import StudySpec
from tests.support.api_client import Api, make_settings, make_tokens
from tests.support.search import drive
from tests.support.specs import small_spec

WORKLOAD = {"output_len": 256, "num_prompts": 32, "concurrency": [1], "repeats": 2}


def _spec(**kw: Any) -> StudySpec:
    return StudySpec.model_validate(small_spec("plan", workload=WORKLOAD, **kw))


def _well_formed(e: Estimate, workers: int, draws: int) -> None:
    assert (e.workers, e.draws) == (workers, draws)
    for s in (e.launches, e.gpu_hours, e.wall_hours):
        assert 0 < s.low <= s.expected <= s.high, s
    # Every launch is at least one baseline and one trial, on the spec's GPUs.
    assert e.launches.low >= 2
    assert e.gpu_hours.expected >= e.wall_hours.expected * 0.5  # hours of at least one GPU busy most of the time


def test_the_estimate_is_well_formed_and_more_workers_finish_sooner() -> None:
    spec = _spec()
    one = estimate(spec, 1, draws=3)
    four = estimate(spec, 4, draws=3)
    _well_formed(one, 1, 3)
    _well_formed(four, 4, 3)
    assert four.wall_hours.expected < one.wall_hours.expected, (one, four)
    # The same draws repeat from the same seed: an estimate is reproducible.
    assert estimate(spec, 1, draws=3) == one


def test_a_bigger_model_costs_more_gpu_hours() -> None:
    """A model served at TP8 (the simulator's large MoE class: 8 GPUs, longer loads) against TP1."""
    small = estimate(_spec(), 2, draws=3)
    big = estimate(_spec(model={"target": "moe-pcie", "draft": "moe-pcie-eagle3", "tp_size": 8}), 2, draws=3)
    assert "tp 8" in big.engines and "tp 1" in small.engines
    assert big.gpu_hours.expected > 2 * small.gpu_hours.expected, (small, big)
    assert big.gpu_hours.low > small.gpu_hours.high


def test_study_plan_prints_the_estimate_and_refuses_a_bad_spec(tmp_path: Path) -> None:
    good = tmp_path / "spec.yaml"
    good.write_text(yaml.safe_dump(small_spec("plan", workload=WORKLOAD)))
    runner = CliRunner()
    out = runner.invoke(app, ["study", "plan", str(good), "--workers", "2", "--draws", "3"])
    assert out.exit_code == 0, out.output
    assert "estimate at 2 worker(s), from 3 rehearsals" in out.output
    assert "launches" in out.output and "80% range" in out.output and "GPU-hours" in out.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(small_spec("plan", workload={**WORKLOAD, "concurrency": []})))
    out = runner.invoke(app, ["study", "plan", str(bad), "--workers", "2"])
    assert out.exit_code == 2 and "is not a valid study spec" in out.output and "Traceback" not in out.output


def test_a_study_is_created_with_its_estimate_and_finishes_against_it(db_url: str, tmp_path: Path) -> None:
    """The create response and the document carry the estimate (made by `study plan` in a child
    process, at the eligible fleet: one worker when none is registered yet); the finished study
    shows what it took against it."""
    from fastapi.testclient import TestClient

    from api.app import create_app

    settings = make_settings(db_url, estimate_draws=2, estimate_timeout_s=300, artifact_dir=str(tmp_path / "a"))
    with TestClient(create_app(settings)) as client:
        api = Api(client, make_tokens(db_url), db_url)
        r = api.post("/v1/studies", "user", small_spec("planned", budget={"max_trials": 4, "converge": False}))
        assert r.status_code == 201, r.text
        plan = r.json()["plan"]
        assert plan is not None and plan["estimate"]["workers"] == 1 and plan["estimate"]["draws"] == 2
        assert plan["actual_launches"] is None and plan["summary"].startswith("estimated ")
        assert api.get("/v1/studies/planned", "user").json()["plan"] == plan
        drive(api, "planned", ["w1", "w2"], "moe-pcie")
        doc = api.get("/v1/studies/planned", "user").json()
    assert doc["state"] == "finished"
    done = doc["plan"]
    assert done["estimate"] == plan["estimate"]
    assert done["actual_launches"] == doc["cost"]["launches"] > 0
    assert done["actual_gpu_hours"] == doc["cost"]["gpu_hours"]
    assert done["actual_wall_hours"] is not None and done["actual_wall_hours"] >= 0
    assert done["launches_inside"] == (plan["estimate"]["launches"]["low"] <= done["actual_launches"]
                                       <= plan["estimate"]["launches"]["high"])  # fmt: skip
    assert f"took {done['actual_launches']} launches" in done["summary"]


def test_no_estimate_when_switched_off(api: Api) -> None:
    r = api.post("/v1/studies", "user", small_spec("unplanned"))
    assert r.status_code == 201 and r.json()["plan"] is None
