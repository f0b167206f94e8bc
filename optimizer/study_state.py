"""A study's state, phase and finish reasons: the conductor's vocabulary (optimizer.conductor).

The database holds the same values (spectune_studies.state, .phase, .finish_rule; CHECK
constraints in migrations/versions/0002 and 0006), so a stored study never carries a value the
conductor does not know.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class StudyState(StrEnum):
    """spectune_studies.state: whether leases are handed out at all."""

    RUNNING = "running"
    STOPPED = "stopped"  # by a user; resumable
    FINISHED = "finished"  # by the conductor, with a FinishReason


class Phase(StrEnum):
    """spectune_studies.phase: what a running study is doing (explicit, never inferred from leases)."""

    SEARCH = "search"  # asking the sampler for configurations
    CONFIRMATION = "confirmation"  # re-measuring the best candidates next to fresh baselines


class FinishReason(StrEnum):
    """Why the search ended (spectune_studies.finish_rule); the words are in `finish_reason`."""

    MAX_TRIALS = "max_trials"
    MAX_HOURS = "max_hours"
    SPACE_EXHAUSTED = "space_exhausted"
    CONVERGED = "converged"  # the stop rule (optimizer.convergence): nothing left is likely to beat the answer
    DOES_NOT_PAY = "does_not_pay"  # the stop rule: nothing is likely to beat the baseline
    PATIENCE = "patience"
    STOPPED_BY_USER = "stopped_by_user"
    STUDY_FAULT = "study_fault"  # stopped: its baseline failed for what it asks, on every host it can


@dataclass(frozen=True)
class Ending:
    """A finish reason with its detail in words (what `finish_reason` shows)."""

    reason: FinishReason
    detail: str


# A running study in confirmation shows this after the reason its search ended (the document only;
# nothing parses it: the phase is its own column).
CONFIRMING_NOTE = "; confirming the best candidates against fresh baselines"


def confirmed_detail(detail: str, done: int) -> str:
    """The finish_reason of a study whose confirmation is over."""
    return f"{detail}; {done} confirmed"


class Outcome(StrEnum):
    """What the answer says, as a word a script can act on (`spectune study best`'s exit status):
    each its own value, so "nothing was measured" can never read as "speculation does not pay"."""

    PAYS = "pays"  # the command speculates: its interval clears 1.0 (at part of the load, adaptively)
    DOES_NOT_PAY = "does_not_pay"  # the best measured reaches at most the baseline
    CANNOT_TELL_APART = "cannot_tell_apart"  # above the baseline, but its interval does not clear 1.0
    NO_ANSWER = "no_answer"  # nothing measured, the measurement saturated, or no deployment started
