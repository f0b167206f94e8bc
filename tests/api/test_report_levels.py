"""The report's plots say which level they draw, draw that level's numbers, show pruned trials, and use integer ticks."""

from __future__ import annotations

import math
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg

from api.documents import LevelAnswer, TrialRow
from api.report import analysis as an
from api.report import plots
from optimizer.space import SpecConfig


def trial(number: int, state: str, steps: int, topk: int, tokens: int, **kw: Any) -> TrialRow:
    return TrialRow.model_validate(
        dict.fromkeys(TrialRow.model_fields)
        | {
            "number": number,
            "state": state,
            "params": {},
            "config": {"num_steps": steps, "topk": topk, "num_draft_tokens": tokens},
            "speedup": kw.get("speedup"),
            "feasible": True,
            "speedup_by_level": kw.get("by_level"),
            "partial_speedup_by_level": kw.get("partial"),
            "levels": [],
            "failure_kind": kw.get("failure_kind"),
        }
    )


def answer(steps: int, topk: int, tokens: int, speedup: float) -> LevelAnswer:
    config = SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=tokens)
    return LevelAnswer(trial_number=0, config=config, speedup=speedup, speedup_interval=None, speculation_pays=True)


# Trial 0 measured 0.96x at concurrency 1 and 1.2x at 4: its objective (the geometric mean) is above 1.
TRIALS = [
    trial(0, "COMPLETE", 3, 1, 4, speedup=math.sqrt(0.96 * 1.2), by_level={"1": 0.96, "4": 1.2}),
    trial(1, "COMPLETE", 2, 2, 4, speedup=math.sqrt(1.3 * 1.1), by_level={"1": 1.3, "4": 1.1}),
    trial(2, "PRUNED", 5, 1, 6, partial={"1": 0.7}),
    trial(3, "COMPLETE", 7, 4, 20, speedup=0.5, failure_kind="oom"),
]


def test_points_carry_the_named_levels_speedup_not_the_objective() -> None:
    at1 = {p.number: p for p in an.points(TRIALS, 1)}
    assert at1[0].speedup == 0.96 and at1[0].objective is not None and at1[0].objective > 1.0
    assert at1[2].pruned and at1[2].speedup == 0.7 and at1[2].objective is None
    assert not at1[3].feasible and at1[3].speedup == 0.5  # the placeholder of a failure
    at4 = {p.number: p for p in an.points(TRIALS, 4)}
    assert at4[0].speedup == 1.2 and 2 not in at4
    assert an.pruned_before(TRIALS, 4) == 1 and an.pruned_before(TRIALS, 1) == 0


def test_speedup_plot_is_labelled_with_its_level_shows_pruned_trials_and_integer_ticks() -> None:
    fig = plots.speedup_vs_params(an.points(TRIALS, 1), 1)
    FigureCanvasAgg(fig).draw()
    steps_ax = fig.axes[0]
    assert steps_ax.get_ylabel() == "speedup at concurrency 1"
    assert "at concurrency 1" in fig.get_suptitle()
    labels = [t.get_text() for t in steps_ax.get_legend().get_texts()]
    assert "pruned (stopped after this level)" in labels and "best at concurrency 1" in labels
    drawn = {tuple(xy) for c in steps_ax.collections for xy in c.get_offsets()}
    assert (3.0, 0.96) in drawn and (5.0, 0.7) in drawn  # trial 0 at its level-1 value; the pruned trial
    assert all(float(x).is_integer() for x in steps_ax.get_xticks())
    assert all(float(x).is_integer() for x in fig.axes[2].get_xticks())  # draft tokens too


def test_level_sentence_comes_from_the_data() -> None:
    same = {"1": answer(3, 1, 4, 1.4), "16": answer(3, 1, 4, 1.1)}
    text = an.best_by_level_text(same)
    assert text is not None and text.startswith("The best configuration is the same at every level")
    same["16"] = answer(1, 1, 2, 1.1)
    text = an.best_by_level_text(same)
    assert text is not None and text.startswith("The best configuration differs by level")
    assert "at concurrency 16: 1/1/2 (1.100x)" in text
