"""The one budget rule: when a study has spent what its spec allows."""

from __future__ import annotations

from datetime import timedelta

from optimizer.spec import Budget


def budget_used(budget: Budget, launched: int, elapsed: timedelta) -> str | None:
    """Why the budget is used up, in words, or None while some remains.

    `launched` counts configurations launched (restarts), not Optuna trials: a proposal answered
    from an earlier trial costs nothing.
    """
    if launched >= budget.max_trials:
        return f"max_trials={budget.max_trials} configurations measured"
    if budget.max_hours is not None and elapsed > timedelta(hours=budget.max_hours):
        return f"max_hours={budget.max_hours} passed"
    return None
