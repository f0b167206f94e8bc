"""The search-efficiency benchmark runs the study the service runs (issue 16: no second loop).

The same study, with the same simulated measurements, once through the REST API (a real app on a
real database, one worker leasing and reporting) and once through `benchmarks/search_efficiency`
(the conductor on an in-memory store): the launches, in order, and the finish reason agree.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime
from typing import Any

import pytest

from api.db import make_engine, make_sessionmaker
from api.services.study_specs import verify_shapes
from benchmarks import search_efficiency as se
from optimizer import ranking
from optimizer.policy import DEFAULT_POLICY
from optimizer.space import SpecConfig
from optimizer.spec import parse_spec
from optimizer.verify_probe import shapes_key
from spectune_sim.landscapes import LANDSCAPES
from tests.support.api_client import Api
from tests.support.search import drive, key_of, sim_levels, sim_probe
from tests.support.specs import small_spec

LANDSCAPE = "moe-pcie"


class SameMeasurements(se.Host):
    """A benchmark host that measures what tests.support.search's workers report."""

    def _measure(self, config: SpecConfig | None) -> list[dict[str, Any]]:
        self._spend(60.0)
        return sim_levels(LANDSCAPE, None if config is None else config.model_dump(mode="json"), self.workload.levels)

    def _probe(self) -> dict[str, Any]:
        probe = sim_probe(LANDSCAPE, self.workload.levels)
        self._spend(float(probe["spent_s"]))
        return probe

    def _launch(self, config: SpecConfig) -> tuple[str, list[dict[str, Any]]]:
        self.last_startup_s = 12.0  # what tests.support.search.ok reports
        return "ok", self._measure(config)


@pytest.mark.parametrize("seed", [3, 7])
def test_the_benchmark_and_the_service_run_the_same_study(api: Api, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every ranking of the candidates, the study document's winner (api.services.studies._winner)
    # and the conductor's alike, by the shapes it was given: one model input, or the printed
    # answer and the conductor's could disagree.
    ranked_with: set[str] = set()
    real_of = ranking.of

    # The confirmation launches each ranking read (optimizer.ranking.Relaunch), in call order.
    relaunched: list[tuple[Any, ...]] = []

    # The policy each ranking was fitted under: the service's everywhere (optimizer.policy).
    policies: set[str] = set()

    def of(
        spec: Any, trials: Any, shapes: Any = None, relaunches: Any = (), policy: Any = DEFAULT_POLICY
    ) -> ranking.Ranking | None:
        if any(t.state.is_finished() for t in trials):
            ranked_with.add(shapes_key(shapes))
        relaunched.append(tuple(sorted(json.dumps(r.key()) for r in relaunches)))
        policies.add(json.dumps(policy.as_json()))
        return real_of(spec, trials, shapes, relaunches, policy)

    monkeypatch.setattr(ranking, "of", of)
    doc = small_spec(f"agree{seed}", sampler="auto", seed=seed, budget={"max_trials": 12})
    doc["confirmation"] = {"top": 2}
    assert api.post("/v1/studies", "user", doc).status_code == 201
    # Each baseline with its verify probe: both stores hand its shape to every fit (issue 31 item 2).
    handed = drive(api, doc["name"], ["w1"], LANDSCAPE, probe=True)
    shown = api.get(f"/v1/studies/{doc['name']}", "user").json()
    assert shown["state"] == "finished"
    kinds = {"baseline": "baseline", "trial": "search", "confirm": "confirm"}
    service = [(kinds[le["kind"]], key_of(le["config"]) if le.get("config") else None) for le in handed]

    served_calls = len(relaunched)
    spec = parse_spec(doc)
    wl = se.Workload(levels=tuple(spec.workload.concurrency))
    plan = se.spectune_plan(spec)
    host = SameMeasurements(LANDSCAPES[LANDSCAPE], wl, plan, random.Random(seed), seed, host_id="w1")
    store = se.drive([host], spec, DEFAULT_POLICY)
    answer = se._study_answer(store, [host], se.Truth(LANDSCAPES[LANDSCAPE], wl, plan, spec.search_space))  # noqa: SLF001

    # The same shapes reach the model on both sides: the service's, read from its database as its
    # snapshot and its study document read them, and the rehearsal's snapshot.
    engine = make_engine(api.db_url or "")
    try:
        with make_sessionmaker(engine)() as s:
            served = verify_shapes(s, spec)
    finally:
        engine.dispose()
    rehearsed = store.snapshot(datetime.now(UTC), ["w1"]).verify_shapes()
    assert served and shapes_key(served) == shapes_key(rehearsed)
    assert ranked_with == {shapes_key(served)}
    assert policies == {json.dumps(DEFAULT_POLICY.as_json())}
    # The study document's ranking and the rehearsal's read the same confirmation launches.
    served_relaunches = max(relaunched[:served_calls], key=len)
    rehearsed_relaunches = max(relaunched[served_calls:], key=len)
    assert served_relaunches and served_relaunches == rehearsed_relaunches
    assert host.history == service
    assert len([k for k, _ in service if k == "search"]) < 12  # the stop rule ended it, not the cap
    assert answer.reason.split(": ", 1)[1] == shown["finish_reason"], (answer.reason, shown["finish_reason"])
    assert answer.rule is not None and f"({answer.rule.replace('_', '-')} rule)" in shown["finish_reason"]


def _answers(launches: list[int], wall_h: list[float]) -> list[se.Answer]:
    return [se.Answer(n, {}, 0.0, {}, 1.0, 0, "converged: x", wall_h=w) for n, w in zip(launches, wall_h, strict=True)]


def _fleet_row(small: list[se.Answer], large: list[se.Answer]) -> list[str]:
    case = se.CASES[0]
    rows = se.fleet_report({2: [(case, small)], 4: [(case, large)]})
    row = next(r for r in rows if r.startswith(f"| {case.label} |"))
    return [c.strip() for c in row.strip("|").split("|")]


def test_the_fleet_table_judges_launches_against_one_baseline_per_extra_host() -> None:
    two = _answers([10, 11, 12, 13, 14], [0.50, 0.50, 0.60, 0.60, 0.70])
    # Median 14 = 12 + 2 (two extra hosts' baselines): met; wall median 0.55 < 0.60: shorter.
    cells = _fleet_row(two, _answers([12, 13, 14, 15, 16], [0.40, 0.50, 0.55, 0.60, 0.70]))
    assert cells[2:5] == ["12 / 14", "14", "yes"]
    assert cells[8] == "yes"
    # Median 15 > 14: not met; the wall median equal to the smaller fleet's is not shorter.
    cells = _fleet_row(two, _answers([13, 14, 15, 16, 17], [0.40, 0.50, 0.60, 0.60, 0.70]))
    assert cells[2:5] == ["12 / 15", "14", "no"]
    assert cells[8] == "no"
    # The interval of the launch difference holds the difference itself.
    diff, interval = cells[5].split(" ", 1)
    lo, hi = (float(x) for x in interval.strip("[]").split(","))
    assert lo <= float(diff) <= hi and lo < hi


def test_the_benchmark_refuses_a_fleet_list_it_cannot_compare(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("2,2", "0", "2,x", ""):
        with pytest.raises(SystemExit) as e:
            se.main(["--workers", bad, "--seeds", "1"])
        assert e.value.code == 2
        assert "--workers" in capsys.readouterr().err
