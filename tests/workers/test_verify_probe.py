"""The verify probe (issue 31 item 2) against the real simulated server, and what is made of it.

The simulator answers a batch of extends of a cached prefix with one forward over the batch's
new tokens, F(b k), the verify cost's form (spectune_sim/model.py `extend_ms`); the worker's probe
(workers/loadgen/probe.py) times such batches; optimizer.verify_probe turns the times into the
verify cost relative to the decode step.  The landscape `zigzag-tiles` steps its forward cost by
0.22 decode steps every 16 tokens, so a tile step must show between 16 and 32 tokens per request.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import httpx
import pytest

from optimizer.verify_probe import ProbePlan, probe_levels, verify_shape
from spectune_protocol import Metrics, VerifyProbe
from spectune_sim.landscapes import get_landscape
from spectune_sim.model import forward_ms
from tests.support.helpers import sim_engine
from workers.loadgen.errors import LoadgenCancelled
from workers.loadgen.probe import ProbeRefused, is_loopback, run_verify_probe

# Slowed down 20x: a forward of zigzag-tiles takes ~133 ms of wall time, so the tile step
# (0.22 x 133 = 29 ms) stands well above the loopback call's few ms of overhead and jitter.
SPEED = 0.05
LANDSCAPE = "zigzag-tiles"


@pytest.fixture(scope="module")
def sim_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("probe")
    model = root / "models" / LANDSCAPE
    model.mkdir(parents=True)
    env = {**os.environ, "SPECTUNE_SIM_TIME_SCALE": "0.01", "SPECTUNE_SIM_SPEED": str(SPEED), "SPECTUNE_SIM_NOISE": "0"}
    args = ["--model-path", str(model), "--max-running-requests", "8"]
    with sim_engine(args, log_path=root / "sim.log", env=env) as (url, _):
        yield url


def expected_s(batch: int, tokens: int) -> float:
    """The simulated engine's own forward over batch x tokens, in wall seconds."""
    return forward_ms(get_landscape(LANDSCAPE), batch * tokens) / 1000.0 / SPEED


def test_probe_times_follow_the_engines_verify_form_with_its_tile_step(sim_url: str) -> None:
    probe = run_verify_probe(sim_url, ProbePlan(levels=(1, 2), tokens=(1, 8, 16, 32), repeats=3))
    assert probe.note is None and probe.cached_share == 1.0 and probe.prefix_tokens > 0
    t = {(p.concurrency, p.tokens): p for p in probe.points}
    assert sorted(t) == [(b, k) for b in (1, 2) for k in (1, 8, 16, 32)]
    assert all(len(p.seconds_runs) == 3 for p in probe.points)
    # Never faster than the engine's forward (a wait is never shorter than asked) ...
    assert all(p.seconds >= 0.98 * expected_s(b, k) for (b, k), p in t.items())
    # ... and the tile step shows as a step: 16 -> 32 tokens costs far more than 8 -> 16.
    step = get_landscape(LANDSCAPE).verify_tile_jump * expected_s(1, 1)
    for b in (1, 2):
        tile = t[(b, 32)].seconds - t[(b, 16)].seconds if b == 1 else t[(b, 16)].seconds - t[(b, 8)].seconds
        before = t[(b, 16)].seconds - t[(b, 8)].seconds if b == 1 else t[(b, 8)].seconds - t[(b, 1)].seconds
        assert tile - before > 0.5 * step, (b, tile, before, step)
    # k x batch is what counts: 2 x 16 crosses the tile as 1 x 32 does; 2 x 32 crosses two more.
    assert t[(2, 32)].seconds - t[(1, 32)].seconds > 1.5 * step


def test_the_shape_relative_to_the_decode_step_recovers_the_engines_ratios(sim_url: str) -> None:
    probe = run_verify_probe(sim_url, ProbePlan(levels=(1, 4), tokens=(1, 4, 16, 32, 64), repeats=3))
    # The baseline's levels as the engine runs them: one decode step emits b tokens.
    levels = [{"concurrency": b, "output_tok_s": b / expected_s(b, 1)} for b in (1, 4)]
    shape = verify_shape(probe.model_dump(mode="json"), levels)
    assert shape is not None and set(shape.points) == {1, 4}
    ls = get_landscape(LANDSCAPE)
    for b in (1, 4):
        assert shape.overhead_s[b] >= 0
        for pt in shape.points[b]:
            want = forward_ms(ls, b * pt.tokens) / forward_ms(ls, b)
            assert pt.ratio == pytest.approx(want, rel=0.08, abs=0.04), (b, pt, want)
    # Between probed counts it interpolates; a batch never probed is left to the model's prior.
    mid = shape.ratio(1, 24)
    assert mid is not None and shape.points[1][2].ratio <= mid <= shape.points[1][3].ratio
    assert shape.ratio(2, 8) is None


def test_the_probe_is_bounded_by_batch_size_budget_and_cancel(sim_url: str) -> None:
    small = run_verify_probe(sim_url, ProbePlan(levels=(1, 2), tokens=(1, 16, 32), repeats=1, max_batch_tokens=32))
    assert {(p.concurrency, p.tokens) for p in small.points} == {(1, 1), (1, 16), (1, 32), (2, 1), (2, 16)}
    assert small.note is not None and "skipped" in small.note
    spent = run_verify_probe(sim_url, ProbePlan(levels=(1,), tokens=(1, 2), budget_s=0.0))
    assert spent.points == [] and spent.note is not None and "budget" in spent.note
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(LoadgenCancelled):
        run_verify_probe(sim_url, ProbePlan(levels=(1,)), cancel=cancel)


def test_only_loopback_is_probed_and_nothing_is_sent_elsewhere() -> None:
    sent: list[httpx.Request] = []
    client = httpx.Client(transport=httpx.MockTransport(lambda r: sent.append(r) or httpx.Response(500)))
    for url in ("http://10.0.0.7:30000", "http://gpu-host.example:30000", "http://[2001:db8::1]:30000"):
        with pytest.raises(ProbeRefused):
            run_verify_probe(url, ProbePlan(levels=(1,)), client=client)
    assert sent == []
    assert all(
        is_loopback(u) for u in ("http://127.0.0.1:1", "http://localhost:2", "http://[::1]:3", "http://127.3.0.1")
    )


def test_an_engine_that_fails_the_probe_ends_it_with_a_note_not_an_error() -> None:
    client = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(400, text="no input_ids here")))
    probe = run_verify_probe("http://127.0.0.1:9", ProbePlan(levels=(1,)), client=client)
    assert probe.points == [] and probe.note is not None and "HTTP 400" in probe.note


def test_probe_levels_are_the_objectives_levels_as_the_server_runs_them() -> None:
    assert probe_levels([1, 4, 64], 16) == (1, 4, 16)
    assert probe_levels([2, 8], None) == (2, 8)


def test_a_baseline_report_without_the_probe_still_validates_and_one_with_it_round_trips() -> None:
    level = {"concurrency": 1, "output_tok_s": 100.0}
    old = Metrics.model_validate({"levels": [level]})
    assert old.verify_probe is None
    probe = {
        "points": [{"concurrency": 1, "tokens": 8, "seconds": 0.012, "seconds_runs": [0.011, 0.012, 0.013]}],
        "prefix_tokens": 256,
        "cached_share": 1.0,
        "spent_s": 3.5,
    }
    new = Metrics.model_validate({"levels": [level], "verify_probe": probe})
    assert isinstance(new.verify_probe, VerifyProbe) and new.verify_probe.points[0].tokens == 8
    assert Metrics.model_validate(new.model_dump(mode="json")) == new
    for bad in ({"seconds": -1.0}, {"tokens": 0}, {"seconds": float("nan")}):
        broken = {**probe, "points": [{**probe["points"][0], **bad}]}
        with pytest.raises(ValueError):
            Metrics.model_validate({"levels": [level], "verify_probe": broken})


def test_the_simulator_reports_cached_tokens_only_for_an_id_prefix_it_has_seen(sim_url: str) -> None:
    prefix = list(range(2000, 2100))
    with httpx.Client(trust_env=False) as c:

        def cached(body: dict[str, object]) -> list[int]:
            r = c.post(f"{sim_url}/generate", json={**body, "sampling_params": {"max_new_tokens": 1}})
            r.raise_for_status()
            out = r.json()
            return [o["meta_info"]["cached_tokens"] for o in (out if isinstance(out, list) else [out])]

        assert cached({"input_ids": prefix}) == [0]
        assert cached({"input_ids": [prefix + [7], prefix + [8, 9]]}) == [100, 100]
        assert cached({"input_ids": prefix}) == [99]  # at least one token is always computed
        assert cached({"text": "the same words " * 20}) == [0]
        assert cached({"text": "the same words " * 20}) == [0]  # text is never cached
        c.post(f"{sim_url}/flush_cache").raise_for_status()
        assert cached({"input_ids": prefix + [7]}) == [0]


def test_the_rehearsals_host_produces_the_same_probe_and_spends_its_time() -> None:
    import random

    from optimizer.rehearsal import Host, Plan, Workload

    host = Host(get_landscape(LANDSCAPE), Workload(levels=(1, 4)), Plan(max_running_requests=4), random.Random(3), 3)
    before = host.clock_s
    levels = host.baseline_levels()
    probe = VerifyProbe.model_validate(host.verify_probe)
    assert {p.concurrency for p in probe.points} == {1, 4} and probe.spent_s > 0
    shape = verify_shape(probe.model_dump(mode="json"), levels)
    assert shape is not None
    ls = get_landscape(LANDSCAPE)
    one = {p.tokens: p.ratio for p in shape.points[1]}
    assert one[32] / one[16] == pytest.approx(forward_ms(ls, 32) / forward_ms(ls, 16), rel=0.08)
    assert host.clock_s - before > probe.spent_s  # the start-up, the passes and the probe


def test_the_models_shape_keeps_rising_and_needs_a_one_token_point() -> None:
    pts = [
        {"concurrency": 1, "tokens": 1, "seconds": 0.010},
        {"concurrency": 1, "tokens": 2, "seconds": 0.0099},  # noise: a dip
        {"concurrency": 1, "tokens": 4, "seconds": 0.012, "seconds_runs": [0.011, 0.012, 0.013]},
    ]
    shape = verify_shape({"points": pts}, [{"concurrency": 1, "output_tok_s": 125.0}])  # an 8 ms step
    assert shape is not None and shape.overhead_s[1] == pytest.approx(0.002)
    ratios = [p.ratio for p in shape.points[1]]
    assert ratios == sorted(ratios) and ratios[0] == pytest.approx(1.0) and ratios[2] == pytest.approx(1.25)
    assert verify_shape({"points": pts[1:]}) is None
