"""Per-user against per-GPU throughput across the levels: baseline, winner, runner-ups, Pareto front."""

from __future__ import annotations

from typing import Any

from api.documents import StudyDocument, TrialRow, Winner
from api.report import plots
from api.report.tradeoff import pareto, series, tradeoff_table
from optimizer.spec import StudySpec
from tests.conftest import small_spec


def level(c: int, user: float, total: float, itl: float) -> dict[str, Any]:
    return {"concurrency": c, "per_user_tok_s": user, "output_tok_s": total, "itl_ms_p99": itl}


BASE = [level(1, 50, 50, 20), level(8, 40, 320, 25)]


def trial(n: int, speedup: float, levels: list[dict[str, Any]]) -> TrialRow:
    return TrialRow.model_validate(dict.fromkeys(TrialRow.model_fields) | {
        "number": n, "state": "COMPLETE", "params": {}, "feasible": True, "speedup": speedup,
        "config": {"num_steps": n, "topk": 1, "num_draft_tokens": n + 1}, "levels": levels, "baseline_levels": BASE,
    })  # fmt: skip


def shown(max_itl: float | None = None) -> StudyDocument:
    """The parts of a study document the trade-off reads: the spec (tp 2) and the winner's trial."""
    model = {"target": "moe-pcie", "draft": "moe-pcie-eagle3", "tp_size": 2}
    spec = StudySpec.model_validate(small_spec("t", model=model, objective={"max_p99_itl_ms": max_itl}))
    return StudyDocument.model_construct(spec=spec, winner=Winner.model_construct(trial_number=3))


TRIALS = [
    trial(3, 1.5, [level(1, 90, 90, 12), level(8, 60, 480, 30)]),
    trial(2, 1.3, [level(1, 70, 70, 15), level(8, 55, 440, 18)]),
    trial(4, 1.2, [level(1, 95, 95, 11), level(8, 45, 360, 40)]),
    trial(5, 1.1, [level(1, 60, 60, 15)]),  # a third runner-up: not drawn
]


def test_series_are_the_baseline_the_winner_and_two_runner_ups_per_gpu() -> None:
    found = series(shown(), TRIALS)
    assert [s.role for s in found] == ["baseline", "winner", "runner-up", "runner-up"]
    assert found[1].label == "winner #3 3/1/4" and [s.label.split()[1] for s in found[2:]] == ["#2", "#4"]
    # tp_size 2: total tok/s per GPU is half the output tok/s.
    assert [(p.concurrency, p.per_user_tok_s, p.tok_s_per_gpu) for p in found[1].points] == [(1, 90, 45), (8, 60, 240)]


def test_the_front_leaves_out_dominated_points_and_those_over_a_latency_limit() -> None:
    found = series(shown(), TRIALS)
    front = pareto(found)
    # #4 at c=1 is the fastest per user; #3 at c=8 the most per GPU; #3 at c=1 is beaten by #4 at c=1 in
    # per-user speed but not per GPU (47.5 vs 45): #4 c=1 dominates it.  The baseline is dominated.
    assert front == {("runner-up #4 4/1/5", 1), ("winner #3 3/1/4", 8)}
    limited = series(shown(max_itl=25.0), TRIALS)
    assert [p.over_limits for p in limited[1].points] == [(), ("itl_ms_p99",)]
    front = pareto(limited)
    assert ("winner #3 3/1/4", 8) not in front and ("runner-up #2 2/1/3", 8) in front
    text = tradeoff_table(shown(max_itl=25.0), TRIALS)
    assert text is not None and "(latency limits: ITL p99 <= 25 ms" in text
    row = next(line for line in text.splitlines() if line.startswith("winner #3 3/1/4") and "  8  " in line)
    assert row.rstrip().endswith("itl_ms_p99")
    fig = plots.tradeoff(limited, front, "ITL p99 <= 25 ms")
    assert len(plots.png(fig)) > 10_000


def test_nothing_measured_draws_nothing() -> None:
    assert series(shown(), []) == [] and tradeoff_table(shown(), []) is None
