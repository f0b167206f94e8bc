"""The estimate a study is created with (api.estimate), and how the finished study compares.

Made once, when the study is created, at the fleet eligible for it then (at least one worker),
and kept with the Optuna study as a user attribute (the spec is kept the same way,
optimizer.study.SPEC_ATTR), so every API process shows the same one and optuna-dashboard lists it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import optuna
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api import documents as D
from api.documents import Estimate
from api.models import LeaseRow, StudyRow
from api.settings import Settings
from optimizer.spec import StudySpec
from optimizer.study_state import StudyState
from workers.lifeline import child_env

ESTIMATE_ATTR = "spectune_estimate"

log = logging.getLogger("spectune.api.studies")


def make(spec: StudySpec, eligible_workers: int, settings: Settings) -> Estimate | None:
    """The estimate at the eligible fleet (one worker when none is registered yet), made by
    `spectune study plan` in a child process: the rehearsals are seconds of Python that would
    hold this process's GIL, which serves the fleet's leases and /healthz.  None when
    `estimate_draws` is 0 or the estimate failed (logged): a study never fails to be created for
    want of an estimate."""
    if settings.estimate_draws <= 0:
        return None
    with tempfile.TemporaryDirectory(prefix="spectune-plan-") as folder:
        path = Path(folder) / "spec.json"
        path.write_text(spec.model_dump_json())
        argv = [sys.executable, "-m", "api.cli", "study", "plan", str(path), "--json"]
        argv += ["--workers", str(max(1, eligible_workers)), "--draws", str(settings.estimate_draws)]
        # Its own process group, told to exit with this process, killed on every way out.
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=child_env()
        )
        try:
            out, err = proc.communicate(timeout=settings.estimate_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("study %s: no estimate within %.0f s", spec.name, settings.estimate_timeout_s)
            return None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if proc.returncode != 0:
        log.warning("study %s: the estimate failed: %s", spec.name, err.decode(errors="replace")[-500:])
        return None
    return Estimate.model_validate_json(out)


def keep(study: optuna.Study, got: Estimate) -> None:
    study.set_user_attr(ESTIMATE_ATTR, got.model_dump(mode="json"))


def against_actual(s: Session, study: optuna.Study, row: StudyRow, cost: D.StudyCost) -> D.PlanCheck | None:
    """The estimate, and once the study finished what it spent and whether that fell in the range."""
    raw = study.user_attrs.get(ESTIMATE_ATTR)
    if raw is None:
        return None
    got = Estimate.model_validate(raw)
    if row.state != StudyState.FINISHED or row.finished_at is None:
        return D.PlanCheck(estimate=got, summary=_said(got))
    first = s.scalar(select(func.min(LeaseRow.leased_at)).where(LeaseRow.study_name == row.name))
    wall = None if first is None else max(0.0, (row.finished_at - first).total_seconds() / 3600)
    inside = got.launches.covers(cost.launches)
    summary = (
        f"{_said(got)}; took {cost.launches} launches, {cost.gpu_hours:.2f} GPU-hours"
        + ("" if wall is None else f", {wall:.2f} h")
        + f": launches {'inside' if inside else 'outside'} the 80% range"
    )
    return D.PlanCheck(
        estimate=got,
        actual_launches=cost.launches,
        actual_gpu_hours=cost.gpu_hours,
        actual_wall_hours=wall,
        launches_inside=inside,
        summary=summary,
    )


def _said(got: Estimate) -> str:
    r = got.launches
    return (
        f"estimated {r.expected:.0f} launches (80%: {r.low:.0f}-{r.high:.0f}), "
        f"{got.gpu_hours.expected:.2f} GPU-hours, {got.wall_hours.expected:.2f} h at {got.workers} worker(s)"
    )
