"""Regression tests for issue 18, "Bounded at the door": one user's study, one worker token or one
bad report never harms the fleet or another study.

Each test names the reproduction it holds.  They run through the app on SQLite and Postgres.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from optimizer.space import SearchSpace
from spectune_protocol import Inventory
from tests.api.test_rest_flow import lease, ok_metrics
from tests.support.api_client import Api, make_settings, make_tokens
from tests.support.specs import INVENTORY, small_spec

# steps 1-64, topk 1..64, draft tokens 2-1024, graph sizes 1..64: accepted in 0.2 s, then every
# report cost 63 s of CPU and 5.3 GB and ended in MemoryError.
HUGE_SPACE = {
    "num_steps": {"low": 1, "high": 64},
    "topk": list(range(1, 65)),
    "num_draft_tokens": {"low": 2, "high": 1024},
    "cuda_graph_max_bs": list(range(1, 65)),
}


def _error(r: Any) -> dict[str, Any]:
    err: dict[str, Any] = r.json()["error"]
    return err


def _refused(api: Api, spec: dict[str, Any], field: str) -> str:
    r = api.post("/v1/studies", "user", spec)
    assert r.status_code == 422, r.text
    assert _error(r)["field"] == field, r.text
    assert api.get("/v1/studies", "user").json() == []
    return str(_error(r)["message"])


# ------------------------------------------------------------------- the study spec


def test_draft_tokens_beyond_what_a_configuration_holds_are_refused(api: Api) -> None:
    """`num_draft_tokens: {low: 2, high: 2000}` was accepted; then every report answered 500."""
    spec = small_spec(
        "wide",
        search_space={
            "num_steps": {"low": 1, "high": 10},
            "topk": [1, 8, 64],
            "num_draft_tokens": {"low": 2, "high": 2000},
        },
    )
    message = _refused(api, spec, "search_space.num_draft_tokens")
    assert "1024" in message


def test_a_space_above_the_limit_is_refused_with_its_count_and_the_limit(api: Api) -> None:
    message = _refused(api, small_spec("huge", search_space=HUGE_SPACE), "search_space")
    assert "237,864,896 configurations" in message and "100,000" in message


def test_the_space_limit_is_a_setting(db_url: str, tmp_path: Path) -> None:
    from api.app import create_app

    tokens = make_tokens(db_url)
    settings = make_settings(db_url, artifact_dir=str(tmp_path / "a"), max_space_configs=50)
    with TestClient(create_app(settings)) as client:
        api = Api(client, tokens)
        count = SearchSpace.model_validate(small_spec()["search_space"]).count_configs()
        assert count > 50
        message = _refused(api, small_spec("capped"), "search_space")
        assert f"{count:,} configurations" in message and "limit of 50" in message
        narrow = small_spec("narrow", search_space={"num_steps": {"low": 1, "high": 4}, "topk": [1]})
        assert api.post("/v1/studies", "user", narrow).status_code == 201


@pytest.mark.parametrize(
    "space",
    [
        {},
        small_spec()["search_space"],
        {"num_steps": {"low": 3, "high": 9}, "topk": [2, 8, 1], "num_draft_tokens": {"low": 5, "high": 40}},
        {
            "num_steps": {"low": 1, "high": 20},
            "topk": [4, 16],
            "num_draft_tokens": {"low": 2, "high": 1024},
            "cuda_graph_max_bs": [8, 16, 64],
        },
        {"num_steps": {"low": 30, "high": 32}, "topk": [2], "num_draft_tokens": {"low": 2, "high": 8}},
    ],
)
def test_the_count_is_the_number_of_configurations(space: dict[str, Any]) -> None:
    s = SearchSpace.model_validate(space)
    assert s.count_configs() == sum(1 for _ in s.iter_configs())


def test_a_grid_above_what_a_budget_can_measure_is_refused(api: Api) -> None:
    space = {"num_steps": {"low": 1, "high": 20}, "topk": [2, 4, 8, 16], "num_draft_tokens": {"low": 2, "high": 1024}}
    assert SearchSpace.model_validate(space).count_configs() > 10_000
    _refused(api, small_spec("grid", search_space=space, sampler="grid"), "sampler")


@pytest.mark.parametrize(
    ("dotted", "value", "field"),
    [
        ("model.extra_args", {"--dtype": "--host"}, "model.extra_args"),
        ("model.extra_args", {"--kv-cache-dtype": "-x"}, "model.extra_args"),
        ("placement", {"gpu": "h" * 129}, "placement.gpu"),  # the bounded value names its key
        ("placement", {"gpu\n": "h200"}, "placement"),
        ("placement", {"gpu": "h200\n"}, "placement"),
    ],
)
def test_option_like_values_and_unbounded_labels_are_refused(api: Api, dotted: str, value: Any, field: str) -> None:
    """`extra_args: {"--dtype": "--host"}` was accepted (201)."""
    spec = small_spec("opt")
    if dotted == "placement":
        spec["placement"] = value
    else:
        spec["model"] = {**spec["model"], "extra_args": value}
    _refused(api, spec, field)


# ------------------------------------------------------------------- what a worker sends


def _inventory(**changes: Any) -> dict[str, Any]:
    return {**INVENTORY, **changes}


@pytest.mark.parametrize(
    ("inventory", "field"),
    [
        (_inventory(models=["m" * 5000]), "models.0"),
        (_inventory(models=[f"model-{i}" for i in range(257)]), "models"),
        (_inventory(labels={"gpu": "x" * 129}), "labels.gpu"),
        (_inventory(labels={f"k{i}": "v" for i in range(73)}), "labels"),
        (_inventory(labels={"gpu": "h200\nforged log line"}), "labels.gpu"),
        (_inventory(sglang_version="garbage"), "sglang_version"),
        (_inventory(hostname="host\x1b[2J"), "hostname"),
        (_inventory(driver_version="550\n"), "driver_version"),
    ],
)
def test_inventories_are_bounded_and_pattern_checked(api: Api, inventory: dict[str, Any], field: str) -> None:
    """150 worker ids x 1 MB inventories made `GET /v1/workers` answer 145 MiB."""
    r = api.post("/v1/workers/w1/lease", "worker", inventory)
    assert r.status_code == 422, r.text
    assert _error(r)["field"].startswith(field), r.text
    assert api.get("/v1/workers", "user").json() == []


def test_the_largest_inventory_is_a_few_hundred_kilobytes() -> None:
    largest = Inventory(
        hostname="h" * 255,
        gpus=[{"index": i, "name": "n" * 128, "memory_mib": 10**12} for i in range(64)],  # type: ignore[misc]
        sglang_version="0.5.23",
        models=[f"{i:03d}" + "m" * 124 for i in range(256)],
        labels={f"{i:02d}" + "k" * 61: "v" * 128 for i in range(72)},
        prompt_files=[f"{i:04d}" + "p" * 124 for i in range(1024)],
    )
    assert len(largest.model_dump_json()) < 256 * 1024


@pytest.fixture
def trial_lease(api: Api) -> tuple[Api, dict[str, Any]]:
    assert api.post("/v1/studies", "user", small_spec("reports")).status_code == 201
    base = lease(api).json()
    assert api.post(f"/v1/leases/{base['lease_id']}/complete", "worker", ok_metrics(90.0)).status_code == 200
    trial = lease(api).json()
    assert trial["kind"] == "trial"
    return api, trial


@pytest.mark.parametrize(
    ("report", "field"),
    [
        # Accepted, it made `GET /v1/studies/{name}`, stop and resume answer 500 for good.
        (ok_metrics(100.0, sglang_version="garbage"), "metrics.sglang_version"),
        (ok_metrics(100.0, sglang_version="0.5.23\n"), "metrics.sglang_version"),
        # A failed report's levels were not checked against the lease's: concurrency 2048 was stored.
        (
            {
                "outcome": "failed",
                "failure": {"kind": "crash", "message": "x", "levels": [{"concurrency": 2048, "output_tok_s": 5.0}]},
            },
            "failure.levels",
        ),
        (
            {
                "outcome": "failed",
                "failure": {
                    "kind": "crash",
                    "message": "x",
                    "levels": [{"concurrency": 1, "output_tok_s": 5.0}, {"concurrency": 1, "output_tok_s": 6.0}],
                },
            },
            "failure.levels",
        ),
    ],
)
def test_reports_outside_the_lease_are_422_and_nothing_is_stored(
    trial_lease: tuple[Api, dict[str, Any]], report: dict[str, Any], field: str
) -> None:
    api, trial = trial_lease
    r = api.post(f"/v1/leases/{trial['lease_id']}/complete", "worker", report)
    assert r.status_code == 422, r.text
    assert _error(r)["field"].startswith(field), r.text
    assert api.get("/v1/studies/reports", "user").status_code == 200
    good = api.post(f"/v1/leases/{trial['lease_id']}/complete", "worker", ok_metrics(100.0, sglang_version="0.5.23"))
    assert good.status_code == 200 and good.json()["state"] == "completed", good.text


def test_a_progress_phase_cannot_forge_a_log_line(trial_lease: tuple[Api, dict[str, Any]]) -> None:
    api, trial = trial_lease
    body = {"step": 0, "concurrency": 1, "output_tok_s": 50.0, "phase": "trial\nINFO forged"}
    r = api.post(f"/v1/leases/{trial['lease_id']}/progress", "worker", body)
    assert r.status_code == 422 and _error(r)["field"] == "phase", r.text
    assert api.post(f"/v1/leases/{trial['lease_id']}/progress", "worker", body | {"phase": "trial"}).status_code == 200
