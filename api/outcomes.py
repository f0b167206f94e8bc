"""The verdict's kind as the terminal shows it: one headline and one exit status per outcome.

`spectune study best` exits with the status, and every place that prints the answer (`show`,
`best`, the demo) leads with the headline, so "nothing was measured" never reads, or exits, like
"speculation does not pay" (a deployment script would switch speculation off on a study that
measured nothing).  2 stays "an error" (api.cli.common.fail).
"""

from __future__ import annotations

from api.documents import StudyDocument
from optimizer.study_state import Outcome

EXIT_PAYS = 0
EXIT_DOES_NOT_PAY = 3
EXIT_NO_ANSWER = 4
EXIT_CANNOT_TELL_APART = 5

EXIT_STATUS: dict[Outcome, int] = {
    Outcome.PAYS: EXIT_PAYS,
    Outcome.DOES_NOT_PAY: EXIT_DOES_NOT_PAY,
    Outcome.NO_ANSWER: EXIT_NO_ANSWER,
    Outcome.CANNOT_TELL_APART: EXIT_CANNOT_TELL_APART,
}

_HEADLINES: dict[Outcome, str] = {
    Outcome.PAYS: "pays: speculation pays here; the command runs it",
    Outcome.DOES_NOT_PAY: "does not pay: speculation does not pay here; the command runs the server without it",
    Outcome.CANNOT_TELL_APART: (
        "cannot tell apart: the best configuration is above the baseline but within noise of it; "
        "the command runs the server without speculation (measure more to tell them apart)"
    ),
    Outcome.NO_ANSWER: "no answer: nothing was measured cleanly, so there is nothing to act on",
}


def headline(shown: StudyDocument) -> str:
    """The answer's first line: its kind, what the command does, and `study best`'s exit status."""
    text = _HEADLINES[shown.outcome]
    if shown.outcome == Outcome.NO_ANSWER:
        if shown.best is None:
            text = "no answer: nothing measured" + (" yet" if shown.state == "running" else "")
        elif shown.deployment is None:
            text = "no answer: no deployment of the answer started, so there is no command"
        else:
            text = "no answer: the answer's measurement saturated the host; it is the host's load, not speculation's"
    return f"{text} (exit {EXIT_STATUS[shown.outcome]})"
