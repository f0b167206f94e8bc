"""Reads of Optuna's own tables with SQL, for views over many studies at once.

Loading every study through Optuna costs queries per study (and, through its cache, every
trial); a list of 300 studies took seconds under load that way.  These queries read Optuna 5's
schema directly (the major version is pinned) and never write it.
"""

from __future__ import annotations

from datetime import datetime

from optuna.trial import TrialState
from sqlalchemy import Engine, text

_COUNTS = text(
    "SELECT s.study_name, t.state, COUNT(*) FROM trials t JOIN studies s ON s.study_id = t.study_id "
    "GROUP BY s.study_name, t.state"
)


def trial_counts(engine: Engine) -> dict[str, dict[str, int]]:
    """Trials per study and state name (every TrialState present, zero when none), in one query."""
    out: dict[str, dict[str, int]] = {}
    with engine.connect() as conn:
        for study, state, n in conn.execute(_COUNTS):
            counts = out.setdefault(str(study), {s.name: 0 for s in TrialState})
            # Optuna stores the enum's name ("COMPLETE"); some drivers hand back the enum itself.
            counts[getattr(state, "name", str(state))] = int(n)
    return out


def empty_counts() -> dict[str, int]:
    return {s.name: 0 for s in TrialState}


_STALE_RUNNING = text(
    "SELECT s.study_name, t.number FROM trials t JOIN studies s ON s.study_id = t.study_id "
    "WHERE t.state = 'RUNNING' AND (t.datetime_start IS NULL OR t.datetime_start <= :before) "
    "ORDER BY s.study_name, t.number"
)


def running_trials_started_before(engine: Engine, before: datetime) -> dict[str, list[int]]:
    """Trial numbers per study that are RUNNING and started at or before `before` (or never
    stamped), in one query: what the orphan sweep looks at on every lease.

    `before` is naive UTC (the database clock), as Optuna 5 stores `datetime_start` in its table
    whatever the process's zone (its model converts local time to naive UTC on write and back on
    read, `storages/_rdb/models.py`): the comparison holds under any TZ
    (tests/api/test_orphan_trial.py, in zones west and east of UTC)."""
    out: dict[str, list[int]] = {}
    with engine.connect() as conn:
        for study, number in conn.execute(_STALE_RUNNING, {"before": before}):
            out.setdefault(str(study), []).append(int(number))
    return out
