"""The search-efficiency benchmark runs the study the service runs (issue 16: no second loop).

The same study, with the same simulated measurements, once through the REST API (a real app on a
real database, one worker leasing and reporting) and once through `benchmarks/search_efficiency`
(the conductor on an in-memory store): the launches, in order, and the finish reason agree.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from benchmarks import search_efficiency as se
from optimizer.space import SpecConfig
from optimizer.spec import parse_spec
from spectune_sim.landscapes import LANDSCAPES
from tests.conftest import Api, small_spec
from tests.search_support import drive, key_of, sim_levels

LANDSCAPE = "moe-pcie"


class SameMeasurements(se.Host):
    """A benchmark host that measures what tests.search_support's workers report."""

    def _measure(self, config: SpecConfig | None) -> list[dict[str, Any]]:
        self._spend(60.0)
        return sim_levels(LANDSCAPE, None if config is None else config.model_dump(mode="json"), self.workload.levels)

    def _launch(self, config: SpecConfig) -> tuple[str, list[dict[str, Any]]]:
        self.last_startup_s = 12.0  # what tests.search_support.ok reports
        return "ok", self._measure(config)


@pytest.mark.parametrize("seed", [3, 7])
def test_the_benchmark_and_the_service_run_the_same_study(api: Api, seed: int) -> None:
    doc = small_spec(f"agree{seed}", sampler="auto", seed=seed, budget={"max_trials": 12})
    doc["confirmation"] = {"top": 2}
    assert api.post("/v1/studies", "user", doc).status_code == 201
    handed = drive(api, doc["name"], ["w1"], LANDSCAPE)
    shown = api.get(f"/v1/studies/{doc['name']}", "user").json()
    assert shown["state"] == "finished"
    kinds = {"baseline": "baseline", "trial": "search", "confirm": "confirm"}
    service = [(kinds[le["kind"]], key_of(le["config"]) if le.get("config") else None) for le in handed]

    spec = parse_spec(doc)
    wl = se.Workload(levels=tuple(spec.workload.concurrency))
    plan = se.spectune_plan(spec)
    host = SameMeasurements(LANDSCAPES[LANDSCAPE], wl, plan, random.Random(seed), seed, host_id="w1")
    answer = se.run_study([host], se.Truth(LANDSCAPES[LANDSCAPE], wl, plan, spec.search_space), spec)

    assert host.history == service
    assert len([k for k, _ in service if k == "search"]) < 12  # the stop rule ended it, not the cap
    assert answer.reason.split(": ", 1)[1] == shown["finish_reason"], (answer.reason, shown["finish_reason"])
    assert answer.rule is not None and f"({answer.rule.replace('_', '-')} rule)" in shown["finish_reason"]
