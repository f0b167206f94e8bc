"""The objectives a server is judged by: the spec's choice, each figure's ratio and intervals, goodput's count."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from optimizer.errors import SpecError
from optimizer.objective import describe, objective_intervals, score_levels
from optimizer.plan import baseline_key
from optimizer.spec import Objective, parse_spec
from spectune_protocol import Slo
from tests.support.specs import small_spec
from workers.loadgen.request import RequestResult
from workers.loadgen.stats import PassResult, summarize_level

OPEN_LOOP = {"request_rate": 4.0, "concurrency": [8]}


def spec_with(objective: dict[str, Any] | None = None, **workload: Any) -> dict[str, Any]:
    extra = {} if objective is None else {"objective": objective}
    return small_spec("o", workload={"output_len": 32, **workload}, **extra)


def test_the_metric_defaults_by_the_workload_and_throughput_on_an_open_loop_is_refused() -> None:
    assert parse_spec(spec_with()).objective.metric == "throughput"
    assert parse_spec(spec_with(**OPEN_LOOP)).objective.metric == "per_user"
    # A spec stored before objectives had names reads as it did.
    assert parse_spec(spec_with({"metric": "speedup"})).objective.name == "throughput"
    for metric in ("throughput", "speedup"):
        with pytest.raises(SpecError) as e:
            parse_spec(spec_with({"metric": metric}, **OPEN_LOOP))
        assert e.value.field == "objective.metric"
        assert "equals the rate times the output length" in e.value.message and "'per_user'" in e.value.message
    with pytest.raises(ValidationError, match="set max_p99_ttft_ms and/or max_p99_itl_ms"):
        parse_spec(spec_with({"metric": "goodput"}, **OPEN_LOOP))


def lv(c: int, runs: dict[str, list[float]], output: float = 100.0) -> dict[str, Any]:
    """A level document: each figure the mean of its passes, output tok/s unmoved."""
    means = {k: sum(v) / len(v) for k, v in runs.items()}
    return {
        "concurrency": c, "output_tok_s": output, "output_tok_s_runs": [output] * 3, "runs": runs,
        "completion_tokens": 3 * 8 * 25, "num_requests": 3 * 8, **means,
    }  # fmt: skip


BASE = lv(1, {"per_user_tok_s": [90, 91, 89], "itl_ms_p99": [12, 12.5, 11.5], "goodput_req_s": [0, 0, 0]})
TRIAL = lv(1, {"per_user_tok_s": [117, 118, 116], "itl_ms_p99": [9, 9.5, 8.5], "goodput_req_s": [3.9, 4.0, 4.1]})


def test_each_objective_is_a_ratio_over_the_baseline_that_reads_higher_is_better() -> None:
    throughput = score_levels(Objective(), [TRIAL], [BASE])
    per_user = score_levels(Objective(metric="per_user"), [TRIAL], [BASE])
    itl = score_levels(Objective(metric="itl", percentile=99), [TRIAL], [BASE])
    assert throughput.value == pytest.approx(1.0)
    assert per_user.value == pytest.approx(117 / 90)
    assert itl.value == pytest.approx(12 / 9)  # lower is better: baseline / trial
    # A baseline meeting the SLO with no request at all reads as 1% of its 4 requests/s meeting it,
    # not a division by zero.
    goodput = score_levels(Objective(metric="goodput", max_p99_itl_ms=10.0), [TRIAL], [BASE])
    assert goodput.value == pytest.approx(4.0 / 0.04) and goodput.violation == 0.0
    # The intervals come from the objective's own passes, not output tok/s's.
    iv = objective_intervals(Objective(metric="per_user"), [TRIAL], [BASE])[1]
    assert iv.low < 117 / 90 < iv.high and iv.low > 1.25
    assert objective_intervals(Objective(), [TRIAL], [BASE])[1].high == pytest.approx(1.0)


def test_the_objective_is_named_and_goodput_studies_share_baselines_only_under_one_slo() -> None:
    assert describe(Objective(metric="ttft", percentile=90, concurrency=4)).startswith(
        "objective: p90 TTFT ratio (baseline / trial), at concurrency 4"
    )
    assert describe(Objective(), [1, 8]).endswith("at the geometric mean over levels")
    assert describe(Objective(), [8]).endswith("at concurrency 8")
    one = parse_spec(spec_with({"metric": "goodput", "max_p99_itl_ms": 10.0}, **OPEN_LOOP))
    other = parse_spec(spec_with({"metric": "goodput", "max_p99_itl_ms": 20.0}, **OPEN_LOOP))
    per_user = parse_spec(spec_with(**OPEN_LOOP))
    assert len({baseline_key(one), baseline_key(other), baseline_key(per_user)}) == 3
    # Any objective but goodput measures the same baseline as before.
    assert baseline_key(per_user) == baseline_key(parse_spec(spec_with({"metric": "itl"}, **OPEN_LOOP)))


def request(ttft_ms: float, tpot_ms: float, tokens: int = 10) -> RequestResult:
    return RequestResult(
        ttft_s=ttft_ms / 1e3, e2e_s=1.0, completion_tokens=tokens, spec_verify_ct=None,
        decode_tok_s=1e3 / tpot_ms, itl_s=[tpot_ms / 1e3] * (tokens - 1),
    )  # fmt: skip


def test_goodput_counts_the_requests_meeting_the_slo_in_each_pass() -> None:
    passes = [
        PassResult(2.0, [request(50, 8), request(50, 12), request(400, 8)]),  # one meets both limits
        PassResult(2.0, [request(50, 8), request(60, 9), request(70, 9.5)]),  # all three do
    ]
    m = summarize_level(1, passes, Slo(ttft_ms=100, itl_ms=10))
    assert m.runs["goodput_req_s"] == [0.5, 1.5] and m.goodput_req_s == 1.0
    assert m.runs["goodput_tok_s"] == [5.0, 15.0]
    assert len(m.runs["per_user_tok_s"]) == 2 and m.ttft_ms_p90 is not None
    # Without an SLO nothing is counted, and the other figures are still there pass by pass.
    plain = summarize_level(1, passes)
    assert plain.goodput_req_s is None and "goodput_req_s" not in plain.runs and len(plain.runs["itl_ms_p99"]) == 2
