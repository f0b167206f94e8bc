"""What a study will likely cost before its first launch (`spectune study plan`), as the service
documents it: optimizer.estimate rehearses the study, with the worker's own handling of a
confirmation's Resolve order (workers.resolve)."""

from __future__ import annotations

from api.documents import Estimate, Spread
from optimizer import estimate as rehearsed
from optimizer.estimate import DEFAULT_DRAWS
from optimizer.spec import StudySpec
from workers.resolve import resolve

__all__ = ["DEFAULT_DRAWS", "estimate"]


def _spread(s: rehearsed.Spread) -> Spread:
    return Spread(expected=s.expected, low=s.low, high=s.high)


def estimate(spec: StudySpec, workers: int, *, draws: int = DEFAULT_DRAWS, seed: int = 0) -> Estimate:
    """Rehearse the study `draws` times, each on its own engine drawn from the prior."""
    got = rehearsed.estimate(spec, workers, resolve, draws=draws, seed=seed)
    return Estimate(
        workers=got.workers,
        draws=got.draws,
        launches=_spread(got.launches),
        gpu_hours=_spread(got.gpu_hours),
        wall_hours=_spread(got.wall_hours),
        engines=got.engines,
    )
