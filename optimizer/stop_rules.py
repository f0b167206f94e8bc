"""Evidence for stopping that does not depend on the model's functional form.

The convergence stop (optimizer.convergence) asks the fitted model whether anything left can beat
the incumbent.  That answer is only as good as the model's form: on an engine it cannot represent
(acceptance that is not smooth in the draft position, a verify cost that steps at tiles) it either
widens its uncertainty and never stops, or is confidently wrong.  The rules here look only at what
was measured, in the order it was measured:

* **prediction check**: every configuration the `auto` sampler proposes carries the model's
  prediction, made before it was launched (`model_prediction`: speedup and the sd of its log);
  a starting point launched blind gets one from the first model that finds it in flight, before
  its result is in (optimizer.model_sampler.in_flight_predictions).
  Each result is compared with it in units of the uncertainty the prediction stated, widened by
  the measurement's own spread and by what host-to-host offsets add (`HOST_SD`: a prediction
  does not know which host will run it).  When the misses over the last `CHECK_WINDOW` results
  are larger than that uncertainty allows (chi-square at `CHECK_LEVEL`), the model is not
  trusted to say what is left, and the empirical rule decides instead.
* **empirical rule** (the incumbent's lead over the last launches): with an untrusted model, stop
  once none of the last k launches beat the incumbent by more than `min_gain`, where k grows with
  how long the search took to find the incumbent (`hold_needed`): a search that found its best
  late is still improving and needs a longer quiet spell to be judged done.  Where the incumbent
  beats the baseline, the k launches are the sampler's walk around it (`walked_since`), not the
  distrusted model's proposals, unless no neighbour is left to walk to.
* **improvement-rate rule**: whatever the model says, stop once no launch has beaten the
  incumbent by more than `min_gain` for `stall_needed` launches (twice the quiet spell above):
  a backstop so a model that keeps widening its uncertainty cannot run a study to its cap.
* **depth probe**: the model rule does not settle while the incumbent is the deepest launch
  (`depth_probe`): what the model says of the draft positions past it is its form's
  extrapolation, and on an engine whose acceptance is not smooth in the position (two-peaks:
  a hard token at position 3, good positions after it) that is where its answer is wrong.  The
  sampler then launches one step deeper; the rule settles once a deeper launch is in.  The case
  that fails without it: family engine 124 (benchmarks/README.md "The depth probe, measured
  again (stop 44)").

All functions are pure: they take the trials (Optuna's FrozenTrial records) and return values.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from optuna.trial import FrozenTrial, TrialState
from scipy.stats import chi2

from optimizer import attrs as A
from optimizer.analysis import level_intervals
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.space import SpecConfig

# The rules' thresholds are the study's policy (optimizer.policy: check_window, check_min,
# check_level, host_sd, confident_sd, measurement_floor, hold_min, stall_min, p_matters), handed
# to each function; the names below are the default policy's values, for callers outside the rules.
HOST_SD = DEFAULT_POLICY.host_sd
HOLD_MIN = DEFAULT_POLICY.hold_min
P_MATTERS = DEFAULT_POLICY.p_matters


class StopRule(enum.StrEnum):
    """Which rule settled the study (the conductor puts it into its finish reason)."""

    MODEL = "model"  # the fitted model: nothing left is likely to beat the incumbent
    EMPIRICAL = "empirical"  # the model failed its prediction check; the incumbent held against the last launches
    IMPROVEMENT_RATE = "improvement_rate"  # no launch beat the incumbent for long, whatever the model says

    @property
    def label(self) -> str:
        """As the finish reason says it: "(improvement-rate rule)"."""
        return f"{self.value.replace('_', '-')} rule"


@dataclass(frozen=True)
class PredictionCheck:
    """How well the model predicted results before they were measured."""

    checked: int  # results in the window that had a prediction
    rms_miss: float  # root mean square of the misses, in units of their stated uncertainty
    trusted: bool
    worst_config: str | None  # the result the model missed most, in the window
    worst_miss: float  # that miss, signed, in units of its stated uncertainty
    excess_sd: float  # log-sd of the confident predictions' misses beyond measurement and hosts (0 if none)
    check_min: int = DEFAULT_POLICY.check_min  # the fewest results it judges from (the policy's)

    def describe(self) -> str:
        if self.checked < self.check_min:
            return f"too few predicted results to check the model ({self.checked})"
        return f"model predictions missed by {self.rms_miss:.1f} sd (rms) over the last {self.checked} results"


@dataclass(frozen=True)
class Launch:
    """One configuration launched by the study, in the order its result arrived."""

    number: int
    config_key: str
    value: float  # 0.0 for a launch that failed or broke a constraint
    worker_id: str | None


def launches(trials: Sequence[FrozenTrial]) -> list[Launch]:
    """Every configuration launched by a lease of its own (not a duplicate answered from an earlier
    trial, not one inferred to fail), finished, in the order its result arrived."""
    out: list[tuple[Any, int, Launch]] = []
    for t in trials:
        r = A.TrialRecord(t)
        if t.state not in (TrialState.COMPLETE, TrialState.PRUNED) or not r.launched:
            continue
        key = r.config_key
        if key is None:
            continue
        feasible = t.state == TrialState.COMPLETE and r.feasible
        value = float(t.value or 0.0) if feasible else 0.0
        done = t.datetime_complete
        out.append(
            (
                done.timestamp() if done is not None else math.inf,
                t.number,
                Launch(t.number, key, value, r.worker_id),
            )
        )
    out.sort(key=lambda x: (x[0], x[1]))
    return [x[2] for x in out]


def measurement_sd(r: A.TrialRecord, policy: Policy = DEFAULT_POLICY) -> float:
    """Log-sd of a trial's objective from its repeated passes (mean over its levels)."""
    ivs = level_intervals(r.levels, r.baseline_levels)
    sds = [math.log(iv.high / iv.low) / (2 * 1.96) for iv in ivs.values() if iv.low > 0]
    if not sds:
        return policy.measurement_floor
    # The objective is a mean of log speedups over the levels: its variance is the mean variance / n.
    return max(policy.measurement_floor, math.sqrt(sum(s * s for s in sds)) / len(sds))


def launch_variance(trials: Sequence[FrozenTrial], policy: Policy = DEFAULT_POLICY) -> float:
    """The noise variance of one more launch's objective, in the prediction check's own terms: the
    median pass spread of the launches measured so far (`measurement_sd`) and a host's offset
    (`policy.host_sd`), which a prediction does not know."""
    sds = [measurement_sd(A.TrialRecord(t), policy) for t in A.measured_feasible(trials, A.LEVELS)]
    spread = float(np.median(sds)) if sds else policy.measurement_floor
    return spread**2 + policy.host_sd**2


def prediction_check(trials: Sequence[FrozenTrial], policy: Policy = DEFAULT_POLICY) -> PredictionCheck:
    """Compare the last `policy.check_window` results with the predictions made before they came in."""
    host_sd = policy.host_sd
    by_number = {t.number: t for t in trials}
    misses: list[tuple[float, str]] = []
    excess: list[float] = []
    for launch in launches(trials):
        r = A.TrialRecord(by_number[launch.number])
        pred = r.model_prediction
        if pred is None or launch.value <= 0:
            continue
        speedup, sd = pred.get("speedup"), pred.get("log_sd")
        if not isinstance(speedup, int | float) or not isinstance(sd, int | float) or speedup <= 0:
            continue
        stated = math.sqrt(float(sd) ** 2 + measurement_sd(r, policy) ** 2 + host_sd**2)
        miss = math.log(launch.value) - math.log(float(speedup))
        misses.append((miss / stated, launch.config_key))
        if float(sd) <= policy.confident_sd:
            excess.append(miss**2 - measurement_sd(r, policy) ** 2 - host_sd**2)
    window = misses[-policy.check_window :]
    if not window:
        return PredictionCheck(0, 0.0, True, None, 0.0, 0.0, policy.check_min)
    recent = excess[-policy.check_window :]
    excess_sd = math.sqrt(max(0.0, sum(recent) / len(recent))) if recent else 0.0
    ms = sum(z * z for z, _ in window) / len(window)
    worst = max(window, key=lambda x: abs(x[0]))
    trusted = len(window) < policy.check_min or bool(ms <= chi2.ppf(policy.check_level, len(window)) / len(window))
    return PredictionCheck(len(window), math.sqrt(ms), trusted, worst[1], worst[0], excess_sd, policy.check_min)


@dataclass(frozen=True)
class Lead:
    """The incumbent against the launches made after it was found."""

    found_at: int  # 1-based position of the incumbent's launch among all launches (0: the baseline)
    since: int  # launches after it, none of which beat it by more than min_gain
    best_since: float  # the best value among them (0.0 when none)
    # The best launch's configuration key (None: the baseline): the centre the sampler walks
    # around.  After a gain within the margin it is a later launch than the one at `found_at`.
    incumbent: str | None = None

    def held(self, needed: int) -> bool:
        return self.since >= needed


def lead(history: Sequence[Launch], min_gain: float, policy: Policy = DEFAULT_POLICY) -> Lead:
    """Where the incumbent (the best launch, or the baseline 1.0x when nothing beats it) was found,
    and how many launches since have failed to beat it by more than `min_gain`.

    The incumbent is "found" at the last launch that beat the value found before it by more than
    `min_gain` plus `policy.host_sd` (what two launches on different hosts differ by without any
    difference in the configuration): a launch that beats it by less is within what the rule
    tolerates, or within the noise, and does not restart the count.  The comparison is with the
    value where the count started, not with the best since: a climb in steps each within the
    margin restarts it once the steps add up to more (two-peaks, seed 17, climbed 2.113 -> 2.134 ->
    2.162 -> 2.208 and stopped on the improvement-rate rule, "none of the last 8 launches beat"
    it, 2.5% below the optimum).
    """
    anchor = 1.0
    found = 0
    margin = (1.0 + min_gain) * math.exp(policy.host_sd)
    for i, launch in enumerate(history):
        if launch.value > anchor * margin:
            found, anchor = i + 1, launch.value
    since = history[found:]
    best_since = max((x.value for x in since), default=0.0)
    # The sampler walks around the best measured trial (model_sampler.best_measured_trial: the
    # lowest trial number among equal values), and only walks around it count (`walked_since`).
    best = max(history, key=lambda x: (x.value, -x.number)) if found else None
    return Lead(found, len(since), best_since, None if best is None else best.config_key)


def walked_since(trials: Sequence[FrozenTrial], history: Sequence[Launch], lead: Lead) -> int:
    """How many of the launches since the incumbent were the sampler's model-free walk around it
    (`move: "local"`, optimizer.model_sampler).

    With a distrusted model these are the empirical rule's evidence: the model's own proposals
    since the incumbent went where a wrong model pointed, so their failing to beat it says little
    of what lies next to it.  On zigzag-tiles with 4 workers, studies stopped on a starting point
    4.4% below the optimum (s4-k4-n16) whose neighbour one draft step deeper (0.4% below) was
    never launched: the model, wrong about the tiles, had proposed elsewhere.
    """
    by_number = {t.number: t for t in trials}
    return sum(1 for x in history[lead.found_at :] if is_walk(by_number.get(x.number), lead.incumbent))


def walks_in_flight(trials: Sequence[FrozenTrial], lead: Lead) -> int:
    """Launches in flight that are the sampler's walk around the incumbent: all that a fleet's
    launches in flight add to the empirical rule's quiet spell (`walked_since`)."""
    return sum(1 for t in trials if t.state == TrialState.RUNNING and is_walk(t, lead.incumbent))


def is_walk(trial: FrozenTrial | None, around: str | None) -> bool:
    """Was `trial` proposed as a step of the sampler's walk around `around` (a configuration key)?
    A walk around an earlier incumbent that was still in flight when this one took the lead is
    not; a walk stored without its centre (before the sampler recorded it) counts."""
    pred = A.TrialRecord(trial).model_prediction if trial is not None else None
    if pred is None or pred.get("move") != "local":
        return False
    centre = pred.get("around")
    return centre is None or around is None or centre == around


def hold_needed(found_at: int, policy: Policy = DEFAULT_POLICY) -> int:
    """Launches without an improvement the empirical rule wants: a search that found its best late
    is still improving, so the quiet spell grows with it."""
    return max(policy.hold_min, math.ceil(found_at / 2))


def stall_needed(found_at: int, policy: Policy = DEFAULT_POLICY) -> int:
    return max(policy.stall_min, found_at)


def launched_configs(trials: Sequence[FrozenTrial]) -> list[SpecConfig]:
    """The configurations of `launches(trials)`, in the order their results arrived."""
    by_number = {t.number: t for t in trials}
    return [A.TrialRecord(by_number[x.number]).config for x in launches(trials)]


def depth_probe(
    trials: Sequence[FrozenTrial], incumbent: SpecConfig, pool: Sequence[SpecConfig], max_steps: int
) -> SpecConfig | None:
    """The launch one draft step past the incumbent, when the incumbent is the deepest launch.

    The model's acceptance past the deepest position it measured is its form's extrapolation,
    not evidence: on an engine whose acceptance is not smooth in the position, the positions
    after the deepest launch are exactly what it cannot say.  None when a deeper configuration
    was launched (any result), the incumbent is at the space's depth, or no such launch is open
    in `pool`.
    """
    deepest = max((c.num_steps for c in launched_configs(trials)), default=0)
    if incumbent.num_steps >= max_steps or deepest > incumbent.num_steps:
        return None
    steps = incumbent.num_steps + 1
    want = incumbent.num_draft_tokens * steps / incumbent.num_steps
    deeper = [c for c in pool if c.num_steps == steps and c.topk == incumbent.topk]
    return min(deeper, key=lambda c: (abs(c.num_draft_tokens - want), c.num_draft_tokens), default=None)
