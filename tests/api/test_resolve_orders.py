"""More passes on the warm server while a confirmation straddles a decision (issue 17 item 4)."""

from __future__ import annotations

import itertools

from spectune_protocol import LevelMetrics, Resolve
from tests.support.api_client import Api
from tests.support.search import lease, ok, sim_levels
from tests.support.specs import small_spec
from workers.resolve import resolve

# The baseline's passes: a 0.5% spread around 1000 tok/s.
BASE = [995.0, 1000.0, 1005.0]


def _level(c: int, runs: list[float]) -> LevelMetrics:
    return LevelMetrics(concurrency=c, output_tok_s=sum(runs) / len(runs), output_tok_s_runs=runs)


def _order(extra_var: float, max_passes: int = 9) -> Resolve:
    return Resolve(
        levels=[4],
        objective_concurrency=None,
        baseline_runs={"4": BASE},
        thresholds=[1.0, 1.01],
        extra_var=extra_var,
        max_passes=max_passes,
    )


def _server(runs: itertools.cycle[float]):  # type: ignore[no-untyped-def]
    """A warm server whose passes alternate around 1030 tok/s (a 3% gain with a 2% pass spread)."""
    calls: list[tuple[list[int], int]] = []

    def measure(concurrency: list[int], passes: int) -> list[LevelMetrics]:
        calls.append((concurrency, passes))
        return [_level(c, [next(runs) for _ in range(passes)]) for c in concurrency]

    return measure, calls


def test_a_straddling_confirmation_is_measured_until_it_resolves() -> None:
    measure, calls = _server(itertools.cycle([1050.0, 1010.0, 1030.0]))
    first = _level(4, [1050.0, 1010.0, 1030.0])
    # Three passes: the interval holds 1.01; more passes of the same server narrow it.
    levels, extra, note = resolve(_order(1e-5), [first], 3, measure)
    assert calls and extra == 3 * len(calls) and note == "resolved", (calls, note)
    assert len(levels[0].output_tok_s_runs) == 3 + extra
    assert levels[0].output_tok_s == sum(levels[0].output_tok_s_runs) / len(levels[0].output_tok_s_runs)


def test_no_passes_when_only_launch_noise_holds_the_threshold() -> None:
    measure, calls = _server(itertools.cycle([1030.0]))
    first = _level(4, [1050.0, 1010.0, 1030.0])
    levels, extra, note = resolve(_order(0.02**2), [first], 3, measure)
    assert calls == [] and extra == 0 and "cannot clear" in note
    assert levels == [first]


def test_the_cap_bounds_the_extra_passes() -> None:
    # A candidate right at 1.01: no number of passes can separate it from the threshold.
    measure, calls = _server(itertools.cycle([1030.0, 990.0]))
    first = _level(4, [1030.0, 990.0, 1010.0])
    _, extra, note = resolve(_order(1e-6, max_passes=4), [first], 3, measure)
    assert extra == 4 and [p for _, p in calls] == [3, 1] and "cap of 4" in note


def test_a_decided_confirmation_gets_no_extra_passes() -> None:
    measure, calls = _server(itertools.cycle([1300.0]))
    first = _level(4, [1295.0, 1300.0, 1305.0])
    _, extra, note = resolve(_order(0.015**2), [first], 3, measure)
    assert calls == [] and extra == 0 and note == "decided without extra passes"


def test_a_confirm_lease_carries_the_order_and_the_extra_passes_count_in_cost(api: Api) -> None:
    spec = small_spec("resolve", budget={"max_trials": 2, "min_gain": 0.02})
    spec["confirmation"] = {"top": 1}
    spec["workload"] = {**spec["workload"], "repeats": 2}
    api.post("/v1/studies", "user", spec)
    confirm = None
    for _ in range(30):  # bounded: two trials, their baselines, then the confirmation
        got = lease(api, "w1")
        if got is None:
            break
        levels = sim_levels("moe-pcie", None if got["kind"] == "baseline" else got["config"], [1])
        for lv in levels:
            lv["output_tok_s_runs"] = [lv["output_tok_s"] * 0.99, lv["output_tok_s"] * 1.01]
        body = ok(levels)
        if got["kind"] == "confirm":
            confirm = got
            body["metrics"] |= {"extra_passes": 4, "extra_passes_note": "resolved"}
        else:
            assert got["resolve"] is None  # only confirmations resolve on the warm server
        assert api.post(f"/v1/leases/{got['lease_id']}/complete", "fleet", body).status_code == 200
    assert confirm is not None
    order = confirm["resolve"]
    assert order["levels"] == [1] and order["thresholds"] == [1.0, 1.02]
    assert order["max_passes"] == 6 and order["extra_var"] > 0
    assert set(order["baseline_runs"]) == {"1"}
    shown = api.get("/v1/studies/resolve", "user").json()
    assert shown["cost"]["extra_passes"] == 4 and "4 extra passes" in shown["cost"]["summary"]
    assert shown["launch_noise"]["sd"] > 0
