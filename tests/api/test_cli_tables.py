"""`study show`'s tables: the workload line, a note for every kind of trial, reasons never cut mid-sentence."""

from __future__ import annotations

from typing import Any

from api.documents import StudyCost, StudyDocument, TrialRow
from api.report.tables import failures_table, shorten, study_summary, trial_note
from optimizer.spec import StudySpec
from tests.support.specs import small_spec


def row(number: int = 0, **fields: Any) -> TrialRow:
    """A trial row with only `fields` set (the rest empty), as the API would send it."""
    base = dict.fromkeys(TrialRow.model_fields) | {"number": number, "state": "COMPLETE", "params": {}}
    return TrialRow.model_validate(base | {"feasible": True} | fields)


REASON = (
    "at concurrency 4 this trial reached 0.912x; even at the top of the noise seen (3.1%) it cannot "
    "reach the best's 1.240x at that level, so the remaining levels would not change the answer."
)


def test_prune_reasons_are_whole_and_failures_cut_at_a_word() -> None:
    trials = [
        row(3, state="PRUNED", pruned={"after_concurrency": 4, "reason": REASON}),
        row(5, failure_kind="crash", failure_message="word " * 40),
    ]
    text = failures_table(trials, width=60)
    assert text is not None and REASON in text
    crash = next(line for line in text.splitlines() if line.startswith("5 "))
    assert crash.endswith("word…") and len(crash.split("crash", 1)[1].strip()) <= 60
    assert shorten("The first sentence here. Then more words follow.", 30) == "The first sentence here. …"
    assert shorten("One. Two three four five six seven eight.", 20) == "One. Two three…"


def test_the_note_column_says_something_for_each_kind_of_trial() -> None:
    assert trial_note(row(pruned={"after_concurrency": 4, "reason": "slow"})) == "pruned after c=4"
    assert trial_note(row(source="warm_start")) == "warm start"
    assert trial_note(row(source="prior_study")) == "from an earlier study"
    assert trial_note(row(duplicate_of=2, source="warm_start")) == "= trial 2"
    assert trial_note(row(inferred_from=7)) == "not launched: OOM like trial 7"
    assert trial_note(row(failure_kind="oom")) == "oom"
    assert trial_note(row()) is None  # the sampler's own proposal, measured: nothing to add


def test_show_states_the_workload_measured() -> None:
    cost = StudyCost.model_construct(summary="0 launches")
    shown = StudyDocument.model_construct(
        name="s", state="running", finish_reason=None, verdict="no result yet", workload="sg.json; inputs as written",
        spec=StudySpec.model_validate(small_spec("s")), eligibility=None, baselines=[], best=None, deployment=None,
        cost=cost,
    )  # fmt: skip
    assert "workload sg.json; inputs as written" in study_summary(shown).splitlines()
