"""Stored trial records, screened before anything renders them; their repair by an admin.

Seen (issue 18): one report with `metrics.sglang_version: "garbage"` was stored, and from then on
the study document, stop and resume answered 500 and `study show/best/export/report` failed
(`parse_version` raised while rendering).  Nothing could repair it.  Reports are now validated
at the door (spectune_protocol), but records stored before, or by a bug, must never make a study
unreadable:

* `screened` gives every reader a copy of the trials in which each value that came from a report
  and fails today's checks is left out and the trial is flagged (`record_problems`); a trial
  whose configuration or measurements are unreadable, or that an admin quarantined, reads as
  FAIL (`failure_kind: "quarantined"`), so it can never be a study's best;
* `repair_trial` (`spectune db repair-trial STUDY NUMBER`) removes the bad values from the stored
  record for good, keeping the originals in an event, and can quarantine a trial whose record
  parses but is known to be wrong (a forged measurement).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from typing import Any

from optuna.trial import FrozenTrial, TrialState
from pydantic import TypeAdapter, ValidationError
from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from api.db import db_now, transaction
from api.errors import NotFoundError
from api.models import EventRow
from optimizer import attrs as A
from optimizer.space import SpecConfig
from optimizer.study import TrialScreen
from spectune_protocol import MAX_EFFECTIVE_DEPTH, LevelMetrics, Version, json_problem

TRIAL_QUARANTINED = "trial_quarantined"
TRIAL_REPAIRED = "trial_record_repaired"
PROBLEMS_ATTR = A.RECORD_PROBLEMS

_VERSION = TypeAdapter(Version | None)
_LEVELS = TypeAdapter(list[LevelMetrics])
# Without these a finished trial cannot be described at all.
_ESSENTIAL = ("config", "levels")


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _problem(key: str, value: Any) -> str | None:
    """Why a stored value fails today's checks (None when it passes, or is not checked)."""
    try:
        if key == "sglang_version":
            _VERSION.validate_python(value)
        elif key == "config":
            SpecConfig.model_validate(value)
        elif key in ("levels", "baseline_levels"):
            _LEVELS.validate_python(value)
        elif key == "effective":
            if not isinstance(value, dict):
                return "not a JSON object"
            return json_problem(value, MAX_EFFECTIVE_DEPTH)
        elif key in ("speedup_by_level", "baseline_tok_s", "partial_speedup_by_level"):
            if not isinstance(value, dict) or not all(isinstance(k, str) and _finite(v) for k, v in value.items()):
                return "not a map of levels to finite numbers"
        elif key == "startup_s":
            if value is not None and not (_finite(value) and 0 <= value <= 1e7):
                return "not a number of seconds"
        elif key == "worker_id":
            if value is not None and not (isinstance(value, str) and len(value) <= 128):
                return "not a worker id"
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where + ': ' if where else ''}{first['msg']}"
    return None


def record_problems(t: FrozenTrial) -> dict[str, str]:
    """The stored values of `t` that fail today's checks: attribute -> why."""
    out: dict[str, str] = {}
    for key, value in t.user_attrs.items():
        problem = _problem(key, value)
        if problem is not None:
            out[key] = problem
    if t.value is not None and not math.isfinite(t.value):
        out["value"] = "not a finite number"
    return out


def quarantined(s: Session, study: str) -> dict[int, str]:
    """Trial number -> the admin's reason, for the trials of `study` an admin quarantined."""
    out: dict[int, str] = {}
    for detail in s.scalars(
        select(EventRow.detail).where(EventRow.kind == TRIAL_QUARANTINED, EventRow.study_name == study)
    ):
        number, _, reason = detail.partition(":")
        if number.isdigit():
            out[int(number)] = reason.strip()
    return out


def screened(trials: Sequence[FrozenTrial], quarantine: dict[int, str] | None = None) -> list[FrozenTrial]:
    """The trials as every reader may use them: bad values left out and flagged (module doc)."""
    quarantine = quarantine or {}
    out: list[FrozenTrial] = []
    for t in trials:
        problems = record_problems(t)
        reason = quarantine.get(t.number)
        if not problems and reason is None:
            out.append(t)
            continue
        c = copy.copy(t)
        attrs = {k: v for k, v in t.user_attrs.items() if k not in problems}
        notes = [f"{k}: {why}" for k, why in sorted(problems.items())]
        broken = [k for k in _ESSENTIAL if k in problems]
        if reason is not None or (t.state == TrialState.COMPLETE and (broken or "value" in problems)):
            # Unusable as a result: read as a failure that says why, never as a best.
            c.state = TrialState.FAIL
            c.values = None
            why = f"quarantined by an admin: {reason}" if reason is not None else "its stored record is unreadable"
            attrs |= {
                "failure_kind": "quarantined",
                "failure_message": f"{why} ({'; '.join(notes) or 'no bad values'})",
            }
        if notes:
            attrs[PROBLEMS_ATTR] = notes
        c.user_attrs = attrs
        out.append(c)
    return out


def sampler_screen(quarantine: dict[int, str]) -> TrialScreen:
    """What the samplers may see (optimizer.study.ScreenedStudy): a quarantined trial as `screened`
    gives it (FAIL, no value), so an admin-quarantined measurement steers no proposal and no
    infeasible configuration's pessimistic value.  Only the quarantined trials are copied: the
    samplers read the trials several times per ask, and the rest were checked at the door."""

    def screen(trials: list[FrozenTrial]) -> list[FrozenTrial]:
        if not quarantine:
            return trials
        return [screened([t], quarantine)[0] if t.number in quarantine else t for t in trials]

    return screen


# ------------------------------------------------------------------ the admin's repair


def _trial_id(s: Session, study: str, number: int) -> int:
    found = s.execute(
        text(
            "SELECT t.trial_id FROM trials t JOIN studies st ON st.study_id = t.study_id "
            "WHERE st.study_name = :study AND t.number = :number"
        ),
        {"study": study, "number": number},
    ).scalar()
    if found is None:
        raise NotFoundError(f"study {study!r} has no trial {number}")
    return int(found)


def repair_trial(factory: sessionmaker[Session], study: str, number: int, quarantine: str | None = None) -> list[str]:
    """Remove the stored values of one trial that fail today's checks (the originals are kept in
    a `trial_record_repaired` event), and quarantine it when asked or when its configuration or
    measurements were among them.  Returns what was done, one line each."""
    done: list[str] = []
    with transaction(factory) as s:
        trial_id = _trial_id(s, study, number)
        rows = s.execute(
            text("SELECT key, value_json FROM trial_user_attributes WHERE trial_id = :id"), {"id": trial_id}
        ).all()
        stored: dict[str, str] = {str(k): str(v) for k, v in rows}
        bad: dict[str, str] = {}
        for key, raw in stored.items():
            try:
                value = json.loads(raw)
            except ValueError:
                bad[key] = "not JSON"
                continue
            problem = _problem(key, value)
            if problem is not None:
                bad[key] = problem
        for key, why in sorted(bad.items()):
            s.execute(
                text("DELETE FROM trial_user_attributes WHERE trial_id = :id AND key = :key"),
                {"id": trial_id, "key": key},
            )
            done.append(f"removed {key} ({why})")
        now = db_now(s)
        if bad:
            original = json.dumps({k: stored[k] for k in sorted(bad)})
            s.add(EventRow(at=now, kind=TRIAL_REPAIRED, study_name=study, detail=f"{number}: {original}"))
        broken = [k for k in _ESSENTIAL if k in bad]
        if quarantine is None and broken:
            quarantine = f"its {' and '.join(broken)} could not be read"
        if quarantine is not None:
            s.add(EventRow(at=now, kind=TRIAL_QUARANTINED, study_name=study, detail=f"{number}: {quarantine}"[:2000]))
            done.append(f"quarantined: {quarantine}")
    return done
