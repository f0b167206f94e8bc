"""A study's launch-to-launch noise, read from the re-launches it made anyway.

Read by the study document, by a confirmation's result and by its resolve order; the conductor
computes the same from its snapshot (optimizer.conductor.launch_noise), both through
`optimizer.confirmation.study_noise`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from optuna.trial import FrozenTrial
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.models import BaselineRow, LeaseRow
from optimizer import confirmation as confirm
from optimizer.analysis import LaunchNoise
from optimizer.plan import baseline_key
from optimizer.spec import StudySpec


def study_noise(s: Session, spec: StudySpec, trials: Sequence[FrozenTrial]) -> LaunchNoise:
    """The launch-to-launch noise of this study's speedups, from the re-launches it made anyway.

    Every baseline launch of its baseline server (any study's: same server, same workload) and
    every completed confirmation (optimizer.confirmation.study_noise).
    """
    baselines = s.scalars(select(BaselineRow).where(BaselineRow.baseline_key == baseline_key(spec))).all()
    rows = s.scalars(
        select(LeaseRow).where(
            LeaseRow.study_name == spec.name, LeaseRow.kind == "confirm", LeaseRow.state == "completed"
        )
    ).all()
    return confirm.study_noise(
        trials,
        [(b.worker_id, b.metrics.get("levels") or []) for b in baselines],
        [c for c in (confirm_measurement(r) for r in rows) if c is not None],
        spec.objective,
    )


def confirm_measurement(
    r: LeaseRow,
) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(configuration key, levels, paired baseline levels) of a completed confirmation."""
    result = r.result or {}
    levels = (result.get("metrics") or {}).get("levels")
    base = (result.get("confirmation") or {}).get("baseline_levels")
    if not levels or not base:
        return None
    return str(r.config_key), levels, base
