"""Which confirmed candidate is best, judged on everything the study measured (issue 17 item 4).

One confirmation launch per candidate cannot order near-equal candidates: a launch moves a
speedup by about as much as the gaps between them (1-2%; `optimizer.analysis.launch_noise`),
and picking the highest of three such confirmations picks the luckiest launch as often as the
best configuration (the winner's curse).  The study's performance model (optimizer.perf_model)
is fitted to every search launch, their accept lengths included: acceptance does not move from
launch to launch, and neighbouring configurations share their draft positions' acceptance and
their cost terms, so the model's *difference* between two candidates is far tighter than either
launch's.  That estimate, shrunk toward what the whole search saw, orders the candidates.

The confirmation launches are data for it too (`Relaunch`): each candidate is confirmed on
another host than the one that found it, against a fresh baseline, so with them the same
configuration stands on two hosts, and what a host's offset or its baseline's launch noise did to
every launch of that host (up to ~10% on the drawn engines of benchmarks/family.py, where the
optimum was launched but the answer lost it to that shift in 4 of 7 misses) becomes something the
model's per-host offsets can tell apart from the configurations.  They do not change whether the
model is trusted: that is judged on the predictions it made before each search launch.

Only the order: the numbers printed with the answer stay those of the launch that proved it
(its confirmation).  Where the model's predictions missed what was then measured, or were not
checked on enough launches (the stop rule's prediction check, optimizer.stop_rules), it is not
trusted and the confirmations alone rank, as before.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial
from scipy.stats import norm

from optimizer import confirmation as confirm
from optimizer import stop_rules as R
from optimizer.gains import gain_over, objective_levels, observations_of
from optimizer.memo import PerStudyMemo
from optimizer.perf_model import Candidates, FittedModel, Observation, fit, observations_from_attrs
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from optimizer.verify_probe import VerifyShape, shapes_key

# A cheaper tied candidate is preferred only when the model is this sure (one-sided, the stop
# rule's `p_matters`: 1.28 sd) that it gives up less than `min_gain` against the best: "cannot
# tell apart" is not "as good", and with launch noise as large as the gaps a one-launch tie says
# little about how much the cheap one loses.
WITHIN_Z = DEFAULT_POLICY.risk_z  # optimizer.policy


@dataclass(frozen=True)
class Relaunch:
    """A completed confirmation launch of a candidate, as the model reads it: what it measured
    against the baseline it was paired with, on its host."""

    config: SpecConfig
    levels: Sequence[Mapping[str, Any]]
    baseline_levels: Sequence[Mapping[str, Any]]
    host: str | None

    def observations(self) -> list[Observation]:
        return observations_from_attrs(
            self.config.model_dump(mode="json"), self.levels, self.baseline_levels, self.host
        )

    def key(self) -> tuple[Any, ...]:
        out = [(int(lv["concurrency"]), lv.get("output_tok_s"), lv.get("accept_length")) for lv in self.levels]
        base = [(int(lv["concurrency"]), lv.get("output_tok_s")) for lv in self.baseline_levels]
        return (self.config.key, self.host, out, base)


@dataclass(frozen=True)
class Ranking:
    """The model's view of a study's candidates (`of`); None from `of` when it has none to trust."""

    spec: StudySpec
    model: FittedModel
    floor_sd: float

    def estimate(self, config: SpecConfig) -> float:
        """The model's objective (speedup) of `config`."""
        levels, weights = objective_levels(self.spec)
        mean, _ = self.model.predict_log_speedup(Candidates.of([config]), levels, weights, with_sd=False)
        return math.exp(float(mean[0]))

    def within(self, config: SpecConfig, best: SpecConfig, min_gain: float) -> float:
        """How many sd of their difference the model is sure that `config` loses less than
        `min_gain` against `best` (negative: it probably loses more)."""
        diff, sd = gain_over(self.spec, self.model, [config], best, self.floor_sd)
        return (math.log1p(min_gain) + float(diff[0])) / max(float(sd[0]), 1e-9)

    def surely_within(self, config: SpecConfig, best: SpecConfig, min_gain: float, z: float = WITHIN_Z) -> bool:
        """Is the model `z` sd sure that `config` loses less than `min_gain` (the policy's `risk_z`)?"""
        return self.within(config, best, min_gain) > z

    def beat_chance(self, config: SpecConfig, best: SpecConfig, min_gain: float) -> float:
        """The model's chance that `config` beats `best` by more than `min_gain` (whether a
        runner-up is worth a confirmation, optimizer.confirmation.candidates)."""
        diff, sd = gain_over(self.spec, self.model, [config], best, self.floor_sd)
        return float(norm.cdf((float(diff[0]) - math.log1p(min_gain)) / max(float(sd[0]), 1e-9)))


def ranks(check: R.PredictionCheck) -> bool:
    """Does a model with this prediction check rank the candidates?  Only once its predictions
    were checked against launches made after them, and held: a model nobody tested (another
    sampler made no predictions) does not overrule a measurement."""
    return check.checked >= check.check_min and check.trusted


def floor_sd(check: R.PredictionCheck, policy: Policy) -> float:
    """The model's misspecification floor: what its own predictions missed by, at least the
    policy's `model_floor`."""
    return max(policy.model_floor, check.excess_sd if check.checked >= check.check_min else 0.0)


def answer_bar(
    spec: StudySpec, trials: Sequence[FrozenTrial], ranking: Ranking, policy: Policy = DEFAULT_POLICY
) -> FrozenTrial | None:
    """The answer the study would stand behind now, by its model: of the candidates the
    confirmation re-measures (optimizer.confirmation.candidates, judged by this ranking), the one
    the model ranks first (`optimizer.answer.choose` asks the same ranking, and answers with it or a
    cheaper one surely within `min_gain` of it).  What is left is weighed against it
    (optimizer.convergence, and the sampler's aim), not against the luckiest launch: with three
    times the calibrated noise a launch draws 3% high now and then, and a bar the model itself
    ranks below a launched configuration keeps a study searching for nothing.  A believed
    launch (optimizer.believer) counts as if it had come in as believed: the believer asks what
    the rule would say then.  None when no candidate is left (nothing measured, or the study
    confirms nothing)."""
    # Ordered by this ranking's estimate, the model's first leads (optimizer.confirmation.candidates).
    chosen = confirm.candidates(list(trials), spec.confirmation.top, spec, 0.0, ranking, policy)
    return chosen[0] if chosen else None


def bar_of(
    spec: StudySpec,
    trials: Sequence[FrozenTrial],
    model: FittedModel,
    check: R.PredictionCheck,
    best: FrozenTrial,
    policy: Policy = DEFAULT_POLICY,
) -> FrozenTrial:
    """What is left must beat (the stop rule and the sampler's aim alike): `answer_bar` where the
    model ranks the candidates, else the incumbent `best`."""
    if not ranks(check):
        return best
    return answer_bar(spec, trials, Ranking(spec, model, floor_sd(check, policy)), policy) or best


_MEMO: PerStudyMemo[Ranking | None] = PerStudyMemo(128)


def of(
    spec: StudySpec,
    trials: Sequence[FrozenTrial],
    shapes: Mapping[str, VerifyShape] | None = None,
    relaunches: Sequence[Relaunch] = (),
    policy: Policy = DEFAULT_POLICY,
) -> Ranking | None:
    """The ranking of a study's candidates by its model (fitted to the search's launches and the
    confirmations' `relaunches`), or None: no model (no accept lengths), one whose predictions were
    not checked on enough launches, or missed what was measured.  `shapes`: the hosts' probed
    verify cost (optimizer.conductor.Snapshot.verify_shapes; the study document passes the same, or
    its winner and the conductor's could differ).  `policy`: the study's (the snapshot's; the model's
    priors and floors and the prediction check read it).  Memoised on the spec, the policy, the
    shapes, the finished trials and the relaunches (the study document asks on every read)."""
    seen = json.dumps(
        [
            spec.model_dump_json(),
            policy.as_json(),
            shapes_key(shapes),
            *((t.number, t.state.name, t.value) for t in trials if t.state.is_finished()),
            *(r.key() for r in relaunches),
        ]
    )
    return _MEMO.get(spec.name, seen, lambda: _fit(spec, trials, shapes, relaunches, policy))


def _fit(
    spec: StudySpec,
    trials: Sequence[FrozenTrial],
    shapes: Mapping[str, VerifyShape] | None,
    relaunches: Sequence[Relaunch],
    policy: Policy,
) -> Ranking | None:
    obs = observations_of(trials) + [o for r in relaunches for o in r.observations()]
    model = fit(obs, spec.search_space.num_steps.high, shapes, policy)
    if model is None:
        return None
    check = R.prediction_check(trials, policy)
    return Ranking(spec, model, floor_sd(check, policy)) if ranks(check) else None
