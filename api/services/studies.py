"""Studies: create, list, show (with the answer a user wants), stop, and finishing rules."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.context import ServiceContext
from api.db import db_now
from api.errors import ConflictError
from api.models import LeaseRow, StudyRow, TrialConfigRow
from optimizer import study as opt
from optimizer.analysis import level_intervals
from optimizer.errors import StudyNotFoundError
from optimizer.plan import baseline_key, server_settings
from optimizer.sglang import launch_command
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec, validate_spec

log = logging.getLogger("spectune.api.studies")


def spec_of(s: Session, name: str) -> StudySpec:
    row = s.get(StudyRow, name)
    if row is None:
        raise StudyNotFoundError(name)
    return StudySpec.model_validate(row.spec)


def baseline_key_of(spec: StudySpec) -> str:
    return baseline_key(spec)


def maybe_finish(s: Session, spec: StudySpec, now: datetime, storage: optuna.storages.BaseStorage) -> None:
    """Mark a running study finished once its budget is used and nothing is in flight."""
    row = s.get(StudyRow, spec.name)
    if row is None or row.state != "running":
        return
    pending = s.scalar(
        select(func.count())
        .select_from(LeaseRow)
        .where(LeaseRow.study_name == spec.name, LeaseRow.kind != "baseline", LeaseRow.state.in_(("queued", "active")))
    )
    if pending:
        return
    launched = s.scalar(select(func.count()).select_from(TrialConfigRow).where(TrialConfigRow.study_name == spec.name))
    launched = launched or 0
    reason = None
    if launched >= spec.budget.max_trials:
        reason = f"max_trials={spec.budget.max_trials} configurations measured"
    elif spec.budget.max_hours is not None and now - row.created_at > timedelta(hours=spec.budget.max_hours):
        reason = f"max_hours={spec.budget.max_hours} passed"
    elif launched >= sum(1 for _ in spec.search_space.iter_configs()):
        reason = "every valid configuration in the search space was measured"
    elif spec.budget.patience is not None:
        reason = _patience_reason(spec, storage)
    if reason is not None:
        row.state = "finished"
        row.finished_at = now
        row.finish_reason = reason
        log.info("study %s finished: %s", spec.name, reason)


def _patience_reason(spec: StudySpec, storage: optuna.storages.BaseStorage) -> str | None:
    """Patience counts measured trials (not duplicates answered from earlier ones) since the best."""
    assert spec.budget.patience is not None
    study = optuna.load_study(study_name=spec.name, storage=storage)
    best_value: float | None = None
    since_best = 0
    for t in sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.number):
        if "duplicate_of" in t.user_attrs or t.value is None:
            continue
        if opt.is_feasible(t) and (best_value is None or t.value > best_value):
            best_value, since_best = t.value, 0
        else:
            since_best += 1
    if best_value is not None and since_best >= spec.budget.patience:
        return f"patience={spec.budget.patience}: no improvement in the last {since_best} trials"
    return None


class StudyService:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def create(self, spec: StudySpec) -> dict[str, Any]:
        validate_spec(spec)
        # Optuna's unique study name is the arbiter of "name taken": it is checked first, and
        # our row follows.  (On SQLite our transaction must not hold the write lock meanwhile.)
        opt.create_study(self.ctx.storage, spec)
        with self.ctx.unit() as u, u.step() as s:
            s.add(
                StudyRow(
                    name=spec.name,
                    state="running",
                    spec=spec.model_dump(mode="json"),
                    baseline_key=baseline_key(spec),
                    created_at=db_now(s),
                )
            )
        return self.show(spec.name)

    def list_studies(self) -> list[dict[str, Any]]:
        with self.ctx.sessions() as s:
            rows = s.scalars(select(StudyRow).order_by(StudyRow.created_at)).all()
        out = []
        for row in rows:
            counts, _ = self._trial_counts(row.name)
            out.append(
                {
                    "name": row.name,
                    "state": row.state,
                    "created_at": row.created_at,
                    "model": row.spec["model"]["target"],
                    "trials": counts,
                }
            )
        return out

    def _trial_counts(self, name: str) -> tuple[dict[str, int], list[FrozenTrial]]:
        study = optuna.load_study(study_name=name, storage=self.ctx.storage)
        trials = study.get_trials(deepcopy=False)
        counts = {state.name: 0 for state in TrialState}
        for t in trials:
            counts[t.state.name] += 1
        return counts, trials

    def stop(self, name: str) -> dict[str, Any]:
        with self.ctx.unit() as u, u.step() as s:
            row = s.get(StudyRow, name)
            if row is None:
                raise StudyNotFoundError(name)
            if row.state == "running":
                row.state = "stopped"
                row.finished_at = db_now(s)
                row.finish_reason = "stopped by a user"
            elif row.state == "stopped":
                pass  # stopping twice is harmless
            else:
                raise ConflictError(f"study {name!r} is already {row.state}")
        return self.show(name)

    def show(self, name: str) -> dict[str, Any]:
        with self.ctx.sessions() as s:
            row = s.get(StudyRow, name)
            if row is None:
                raise StudyNotFoundError(name)
            spec = StudySpec.model_validate(row.spec)
            launched = s.scalar(
                select(func.count()).select_from(TrialConfigRow).where(TrialConfigRow.study_name == name)
            )
            baselines = s.scalar(
                select(func.count())
                .select_from(LeaseRow)
                .where(LeaseRow.study_name == name, LeaseRow.kind == "baseline", LeaseRow.state == "completed")
            )
        counts, trials = self._trial_counts(name)
        best = opt.best_trial_of(trials)
        return {
            "name": name,
            "state": row.state,
            "finish_reason": row.finish_reason,
            "created_at": row.created_at,
            "finished_at": row.finished_at,
            "spec": row.spec,
            "trials": counts,
            "configurations_launched": launched,
            "baselines_measured": baselines,
            "best": None if best is None else self._describe_best(spec, best),
            "verdict": _verdict(best),
        }

    @staticmethod
    def _describe_best(spec: StudySpec, t: FrozenTrial) -> dict[str, Any]:
        config = SpecConfig.model_validate(t.user_attrs["config"])
        settings = server_settings(spec, config, deployment=True)
        version = t.user_attrs.get("sglang_version") or "0.5.23"
        return {
            "trial_number": t.number,
            "params": t.params,
            "config": config.model_dump(mode="json"),
            "speedup": t.value,
            "speedup_by_level": t.user_attrs.get("speedup_by_level"),
            "speedup_interval_by_level": {
                str(c): {"low": iv.low, "high": iv.high}
                for c, iv in level_intervals(
                    t.user_attrs.get("levels") or [], t.user_attrs.get("baseline_levels") or []
                ).items()
            },
            "levels": t.user_attrs.get("levels"),
            "worker_id": t.user_attrs.get("worker_id"),
            "sglang_version": version,
            "launch_command": launch_command(settings, version=version),
        }

    def trials(self, name: str) -> list[dict[str, Any]]:
        with self.ctx.sessions() as s:
            if s.get(StudyRow, name) is None:
                raise StudyNotFoundError(name)
        _, trials = self._trial_counts(name)
        out = []
        for t in trials:
            ua = t.user_attrs
            out.append(
                {
                    "number": t.number,
                    "state": t.state.name,
                    "params": t.params,
                    "config": ua.get("config"),
                    "speedup": t.value,
                    "feasible": opt.is_feasible(t),
                    "constraints": t.constraints,
                    "speedup_by_level": ua.get("speedup_by_level"),
                    "levels": ua.get("levels"),
                    "effective": ua.get("effective"),
                    "startup_s": ua.get("startup_s"),
                    "worker_id": ua.get("worker_id"),
                    "failure_kind": ua.get("failure_kind"),
                    "failure_message": ua.get("failure_message"),
                    "duplicate_of": ua.get("duplicate_of"),
                    "datetime_start": t.datetime_start,
                    "datetime_complete": t.datetime_complete,
                }
            )
        return out


def _verdict(best: FrozenTrial | None) -> str:
    if best is None or best.value is None:
        return "no result yet"
    if best.value > 1.0:
        return f"speculation pays: best configuration is {best.value:.3f}x the baseline (trial {best.number})"
    return f"speculation does not pay here: the best configuration reaches only {best.value:.3f}x the baseline"
