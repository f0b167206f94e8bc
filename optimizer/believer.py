"""The launches in flight as the model expects them: what the stop rule would say once they are in.

A fleet asks for a launch while others are still running.  If the model, trusted by its own
prediction check, would stop the study once those launches come in at the values it predicted
for them, a further launch now is most likely spent on a question they answer; the conductor
holds it back (`optimizer.conductor.in_flight_settles`) and asks again when a result beats the
prediction.  This is the "believer" of batch Bayesian optimisation (kriging believer): each launch
in flight is treated as measured at the model's mean.

Only launches that carry the model's prediction (`model_prediction`) are believed: those it
proposed, and starting points launched blind once a model has predicted them in flight
(optimizer.model_sampler.in_flight_predictions); a blind start no model has predicted yet is
not.  The believed trials keep their trial number and configuration, report the fitted accept
length and cycle ratio at each level against the baseline of their host (so the refit sees them
as the model would have measured them), carry no prediction of their own and are marked
`believed`, so neither the prediction check nor the model's misfit factor
(optimizer.convergence) is flattered by results that match the fit by construction.  A launch
in flight whose first levels already report (`progress_speedup_by_level`) is still believed at
the prediction: the hold lasts only until its result.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from optuna.trial import FrozenTrial, TrialState

from optimizer import attrs as A
from optimizer.model_sampler import objective_levels, observations_of
from optimizer.perf_model import Candidates, fit, per_user_rate
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.spec import StudySpec
from optimizer.verify_probe import VerifyShape


def believed(
    spec: StudySpec,
    trials: Sequence[FrozenTrial],
    now: datetime,
    hosts: Mapping[int, str] | None = None,
    shapes: Mapping[str, VerifyShape] | None = None,
    policy: Policy = DEFAULT_POLICY,
) -> list[FrozenTrial] | None:
    """`trials` with each running launch that carries the model's prediction completed at the fitted
    values, its result arriving after every real one (at `now` when none is in), from its host
    (`hosts`: trial number -> the worker whose lease runs it); None when no launch in flight
    carries a prediction or there is no model to believe.  `policy`: the study's, as the stop
    rule fits under it."""
    running = {
        t.number: t
        for t in trials
        if t.state == TrialState.RUNNING and (r := A.TrialRecord(t)).model_prediction is not None and r.has_config
    }
    if not running:
        return None
    model = fit(observations_of(trials), spec.search_space.num_steps.high, shapes, policy)  # the stop rule's fit
    if model is None:
        return None
    levels, weights = objective_levels(spec)
    out = [t for t in trials if t.number not in running]
    # The rule reads launches in the order their results arrived: a believed one arrives after
    # every real result, on the clock that stamped those (Optuna's, not the caller's `now`).
    done = [t.datetime_complete for t in out if t.datetime_complete is not None]
    arrives = max(done) + timedelta(microseconds=1) if done else now
    for t in running.values():
        r = A.TrialRecord(t)
        worker = (hosts or {}).get(t.number) or r.worker_id
        base = _baseline_levels(trials, worker)
        if base is None or any(c not in base for c in levels):
            return None
        level_docs = []
        for c, (al, ratio) in zip(levels, model.predict_levels(r.config, levels), strict=True):
            user = base[c] * al / ratio  # a verify cycle of `ratio` plain decode steps yields `al` tokens
            level_docs.append({"concurrency": c, "output_tok_s": user * c, "per_user_tok_s": user, "accept_length": al})
        mean, _ = model.predict_log_speedup(Candidates.of([r.config]), levels, weights, with_sd=False)
        value = math.exp(float(mean[0]))
        attrs = {k: v for k, v in t.user_attrs.items() if k != A.MODEL_PREDICTION}
        attrs[A.BELIEVED] = True
        if worker is not None:
            attrs[A.WORKER_ID] = worker
        attrs[A.LEVELS] = level_docs
        attrs[A.BASELINE_LEVELS] = [
            {"concurrency": c, "output_tok_s": base[c] * c, "per_user_tok_s": base[c]} for c in levels
        ]
        out.append(
            FrozenTrial(
                number=t.number,
                state=TrialState.COMPLETE,
                value=value,
                values=None,
                datetime_start=t.datetime_start,
                datetime_complete=arrives,
                params=t.params,
                distributions=t.distributions,
                user_attrs=attrs,
                system_attrs=dict(t.system_attrs),
                intermediate_values={},
                trial_id=t._trial_id,  # noqa: SLF001 - a copy of the running trial, completed
            )
        )
    return out


def _baseline_levels(trials: Sequence[FrozenTrial], worker_id: str | None) -> dict[int, float] | None:
    """Per-user baseline rate by level of the latest measured trial of `worker_id` (any host's when
    it has none yet): the fitted cycle ratio is relative to a plain decode step, so any host's
    baseline gives the speedup the model predicts; the host's own keeps the record true to it."""
    done = [t for t in trials if t.state == TrialState.COMPLETE and A.TrialRecord(t).baseline_levels]
    own = [t for t in done if A.TrialRecord(t).worker_id == worker_id] or done
    if not own:
        return None
    latest = max(own, key=lambda t: (t.datetime_complete.timestamp() if t.datetime_complete else 0.0, t.number))
    out: dict[int, float] = {}
    for lv in A.TrialRecord(latest).baseline_levels:
        c = int(lv["concurrency"])
        v = per_user_rate(lv, c)
        if v is not None:
            out[c] = v
    return out
