"""optimizer.memo.PerStudyMemo: the stop rule's and the ranking's memo of a model fit."""

from __future__ import annotations

from optimizer.memo import PerStudyMemo


def test_a_study_is_recomputed_only_when_its_inputs_change_and_the_least_recently_computed_goes_first() -> None:
    calls: list[str] = []

    def compute(tag: str) -> str:
        calls.append(tag)
        return tag

    memo: PerStudyMemo[str] = PerStudyMemo(2)
    assert memo.get("a", (1,), lambda: compute("a1")) == "a1"
    assert memo.get("a", (1,), lambda: compute("again")) == "a1"  # same inputs: kept
    assert memo.get("a", (1, 2), lambda: compute("a2")) == "a2"  # a new result: refit
    memo.get("b", (1,), lambda: compute("b1"))
    memo.get("c", (1,), lambda: compute("c1"))  # over the bound: the least recently computed (a) goes
    assert memo.get("b", (1,), lambda: compute("again")) == "b1"
    assert memo.get("a", (1, 2), lambda: compute("a2 again")) == "a2 again"
    assert calls == ["a1", "a2", "b1", "c1", "a2 again"]
