"""Is the answer known?  The convergence stop (spec `budget.min_gain`, on by default).

After each result the study asks its fitted model (optimizer.perf_model) two questions:

1. Could one launch of a configuration not yet launched still move the study's answer past the
   incumbent by more than `min_gain`, with a probability that matters (`P_MATTERS`)?  The answer
   is the model's estimate, so a launch moves it only as far as the model believes the launch
   (optimizer.gains.moved_sd, the preposterior; the policy's `answer_moves`).  The incumbent is
   the best measured configuration, or the baseline (1.0x) when none beats it: the same rule then ends a study in
   which nothing is likely to pay ("speculation does not pay").  Where the model ranks the
   confirmed candidates, the bar is the answer the study would give now (ranking.answer_bar),
   not a launch that drew lucky noise.  Each candidate's chance counts the model's own
   uncertainty (Laplace), the incumbent's measurement spread, its risk of running out of
   memory, and is widened by how badly the model explains what was measured (the misfit
   factor), so a model that is wrong about this engine keeps the study going.
2. Is the incumbent measured tightly enough to rank it: its 95% interval no wider than
   `TIGHT` either side, or a confirmation to come (which re-measures it).

Both settled -> the study moves to confirmation and finishes, with a reason in words.  Before
`MIN_MEASURED` configurations are measured the model has too little to stand on and the answer
is always "not yet".

The model's answer counts only while the model predicts well (optimizer.stop_rules): each result
is checked against the prediction made before it came in, and when the misses exceed the
uncertainty the predictions stated, the study stops by the empirical rule instead (the incumbent
held against the last launches).  The improvement-rate rule stops any study in which no launch
has beaten the incumbent for long.  `Assessment.rule` says which rule settled it, and the reason
says so in words.  Per-host offsets that a host's own baseline does not cancel are part of the
noise the misfit expects (each host's mean residual is fitted as a shrunken offset), so a study
on four hosts is not read as a worse model than one on two.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from optuna.trial import FrozenTrial
from scipy.stats import norm

from optimizer import attrs as A
from optimizer import decide, ranking
from optimizer import stop_rules as R
from optimizer.confirmation import objective_interval
from optimizer.gains import beat_z
from optimizer.model_sampler import OpenPool, gain_over, local_moves, objective_levels, observations_of, open_pool
from optimizer.objective import objective_intervals
from optimizer.perf_model import Candidates, FittedModel, fit
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from optimizer.stop_rules import StopRule
from optimizer.verify_probe import VerifyShape

# The rule's thresholds (p_matters, min_measured, tight, depth_probe) are the study's
# policy (optimizer.policy), handed to `assess`; these names are the default policy's values, for
# callers outside the rule.
P_MATTERS = DEFAULT_POLICY.p_matters
MIN_MEASURED = DEFAULT_POLICY.min_measured


@dataclass(frozen=True)
class Assessment:
    settled: bool
    reason: str
    measured: int
    open_configs: int
    # The search's move (optimizer.decide): the largest chance per typical launch's GPU-seconds that
    # an open configuration's launch moves the answer past the bar.
    best_chance: float
    best_chance_config: str | None
    misfit: float
    pays: bool | None  # None while unsettled
    rule: StopRule | None = None  # which rule settled it; None while unsettled
    check: R.PredictionCheck | None = None  # the model's prediction check, once there is a model
    # The launches the empirical rule counts towards its quiet spell (`quiet_spell`), and whether
    # those are the sampler's walk around the incumbent (then only a walk in flight adds to them).
    quiet: int = 0
    walking: bool = False

    @property
    def model_trusted(self) -> bool:
        return self.check is None or self.check.trusted

    def as_json(self) -> dict[str, object]:
        return {
            "settled": self.settled,
            "reason": self.reason,
            "rule": None if self.rule is None else self.rule.value,
            "measured": self.measured,
            "open_configs": self.open_configs,
            "best_chance": self.best_chance,
            "best_chance_config": self.best_chance_config,
            "misfit": self.misfit,
            "model_trusted": self.model_trusted,
            "prediction_rms_miss": None if self.check is None else self.check.rms_miss,
        }


def host_misfit(
    resid_log: np.ndarray, sd: np.ndarray, hosts: Sequence[str | None], host_sd: float = DEFAULT_POLICY.host_sd
) -> float:
    """How far the measurements lie from the model's fit, in its own sd, once each host's offset
    is taken out (a random effect with prior sd `host_sd`: its mean residual, shrunk towards 0 by
    how many results the host has).  Never below 1."""
    e = np.asarray(resid_log, dtype=float)
    w = 1.0 / np.asarray(sd, dtype=float) ** 2
    adjusted = e.copy()
    for h in set(hosts):
        idx = np.array([x == h for x in hosts])
        offset = float((e[idx] * w[idx]).sum() / (w[idx].sum() + 1.0 / host_sd**2))
        adjusted[idx] -= offset
    z = adjusted * np.sqrt(w)
    return float(max(1.0, math.sqrt(float(np.mean(z**2)))))


def assess(
    spec: StudySpec,
    trials: Sequence[FrozenTrial],
    policy: Policy = DEFAULT_POLICY,
    shapes: Mapping[str, VerifyShape] | None = None,
) -> Assessment:
    """The stop rule's view of the study; `shapes`: the hosts' probed verify cost for the model
    (optimizer.conductor.Snapshot.verify_shapes)."""
    measured = A.measured_feasible(trials, A.LEVELS)
    n = len({A.TrialRecord(t).config_key for t in measured})
    gain = spec.budget.min_gain

    def unsettled(reason: str, chance: float = 1.0, key: str | None = None, misfit: float = 1.0) -> Assessment:
        return Assessment(False, reason, n, -1, chance, key, misfit, None)

    if n < policy.min_measured:
        return unsettled(f"only {n} configurations measured; the model needs at least {policy.min_measured}")
    history = R.launches(trials)
    lead = R.lead(history, gain, policy)
    best = max(measured, key=lambda t: float(t.value or 0.0))
    best_value = float(best.value or 0.0)
    pays_now = best_value > 1.0
    bar_value = max(best_value, 1.0)
    best_r = A.TrialRecord(best)
    label = best_r.config_key
    iv = objective_interval(
        spec, best_value, objective_intervals(spec.objective, best_r.levels, best_r.baseline_levels)
    )
    # A believed launch (optimizer.believer) has no passes to show its spread: never tight.
    tight = not best_r.has(A.BELIEVED) and (iv is None or (iv.high / iv.low) ** 0.5 - 1.0 <= policy.tight)
    if pays_now and not tight and spec.confirmation.top <= 0:
        return Assessment(
            False,
            f"{label} leads but its interval is wider than ±{100 * policy.tight:.0f}% and no confirmation is set",
            n,
            -1,
            1.0,
            None,
            1.0,
            None,
        )
    model = fit(observations_of(trials), spec.search_space.num_steps.high, shapes, policy)
    check = R.prediction_check(trials, policy) if model is not None else None
    op = open_pool(spec, trials, policy)
    # The bar what is left must beat: the incumbent, or where the model ranks the confirmed
    # candidates, the one it ranks first (ranking.answer_bar: the answer, not the luckiest launch).
    bar = best
    if model is not None and check is not None:
        floor = ranking.floor_sd(check, policy)
        if pays_now:
            bar = ranking.bar_of(spec, trials, model, check, best, policy)
        # What one more launch may move the model by (None: the configuration's value itself).
        moves = R.launch_variance(trials, policy) if policy.answer_moves else None
        move, misfit = _model_chance(
            spec, model, trials, measured, best_value, A.TrialRecord(bar).config, op, gain, floor, policy, moves
        )
        # The rule (optimizer.decide.worth) weighs the move's chance per typical launch.
        top, top_key = (0.0, None) if move is None else (move.rate, move.key)
    else:
        top, top_key, misfit, move = 1.0, None, 1.0, None
    bar_r = A.TrialRecord(bar)
    moved = bar_r.config_key != label  # ties by value keep the incumbent's name
    left = f"none of the {len(op.configs)} configurations left" if op.configs else "no configuration is left that"
    incumbent = f"{label} ({best_value:.3f}x)" if pays_now else f"the baseline (best launched: {best_value:.3f}x)"
    # In words: what the model weighed what is left against.
    against = (
        f"{bar_r.config_key} (measured {float(bar.value or 0.0):.3f}x; the model ranks it above {label}, "
        f"measured {best_value:.3f}x)"
        if moved
        else incumbent
    )

    # The sampler walks only where it has a model that failed its check (model_sampler._local_moves).
    walks = pays_now and model is not None and check is not None and not check.trusted
    quiet_n, walk = quiet_spell(spec, trials, history, lead, best_r, op, policy) if walks else (lead.since, False)

    def settle(rule: StopRule, why: str) -> Assessment:
        if pays_now:
            reason = f"converged after {n} configurations ({rule.label}): {why}"
        else:
            reason = f"speculation does not pay ({rule.label}): after {n} configurations the best is {best_value:.3f}x; {why}"
        return Assessment(True, reason, n, len(op.configs), top, top_key, misfit, pays_now, rule, check, quiet_n, walk)

    def waiting(why: str) -> Assessment:
        return Assessment(False, why, n, len(op.configs), top, top_key, misfit, None, None, check, quiet_n, walk)

    trusted = model is not None and (check is None or check.trusted)
    probe = (
        R.depth_probe(trials, bar_r.config, op.configs, spec.search_space.num_steps.high)
        if policy.depth_probe and trusted and pays_now and top < policy.p_matters
        else None
    )
    if probe is not None:
        return waiting(
            f"the model sees nothing left to beat {against}, but {bar_r.config_key} is the deepest launch: "
            f"one launch one draft step deeper ({probe.key}) first"
        )
    if trusted and top < policy.p_matters:
        # "to show it beats": in what one launch of it can show (`answer_moves`).
        verb = "show it beats" if policy.answer_moves else "beat"
        # The chance is per typical launch's GPU-seconds (optimizer.decide); the words stay short,
        # as a finish reason is stored within a bound.
        return settle(
            StopRule.MODEL,
            f"{left} has a {100 * policy.p_matters:.0f}% chance to {verb} "
            f"{against if pays_now else 'the baseline'} by more than {100 * gain:.0f}%",
        )
    quiet = f"none of the last {lead.since} launches beat {incumbent} by more than {100 * gain:.0f}%" + (
        f" (best of them {lead.best_since:.3f}x)" if lead.since else ""
    )
    walked = f", {quiet_n} of them its neighbours" if walk else ""
    if not trusted and quiet_n >= R.hold_needed(lead.found_at, policy):
        distrust = (
            check.describe() if check is not None else "the engine reports no accept length, so there is no model"
        )
        return settle(StopRule.EMPIRICAL, f"{distrust}, not trusted; {quiet}{walked}")
    if lead.since >= R.stall_needed(lead.found_at, policy):
        return settle(StopRule.IMPROVEMENT_RATE, f"{quiet}; the incumbent was found at launch {lead.found_at}")
    if not trusted:
        need = R.hold_needed(lead.found_at, policy)
        distrust = check.describe() if check is not None else "the engine reports no accept length"
        what = "launches around" if walk else "launches without a gain over"
        return waiting(f"{distrust}; the empirical rule waits for {need} {what} {incumbent} ({quiet_n} so far)")
    # Trusted, and something left has at least a p_matters chance (else the model rule settled above).
    over = f"{bar_r.config_key} (the model's first)" if moved else f"{bar_value:.3f}x"
    priced = "" if move is None or abs(move.cost - 1.0) <= 0.005 else f" at {move.cost:.2f}x a typical launch"
    return waiting(
        f"{top_key} may still beat {over} by more than {100 * gain:.0f}% "
        f"(chance {100 * (top if move is None else move.chance):.0f}%{priced}, model misfit x{misfit:.1f})"
    )


def quiet_spell(
    spec: StudySpec,
    trials: Sequence[FrozenTrial],
    history: Sequence[R.Launch],
    lead: R.Lead,
    best: A.TrialRecord,
    op: OpenPool,
    policy: Policy = DEFAULT_POLICY,
) -> tuple[int, bool]:
    """The launches the empirical rule counts since the incumbent that beats the baseline, and
    whether they are the walk around it: the sampler's local moves (optimizer.stop_rules.walked_since)
    while a neighbour is left to walk to, else every launch since."""
    moves = local_moves(best.config, op.configs, spec.search_space, R.launched_configs(trials), policy.local_radii)
    if not moves.index.size:
        return lead.since, False
    return R.walked_since(trials, history, lead), True


def _model_chance(
    spec: StudySpec,
    model: FittedModel,
    trials: Sequence[FrozenTrial],
    measured: Sequence[FrozenTrial],
    best_value: float,
    bar: SpecConfig,
    op: OpenPool,
    gain: float,
    floor_sd: float,
    policy: Policy = DEFAULT_POLICY,
    launch_var: float | None = None,
) -> tuple[decide.Move | None, float]:
    """The search's move (optimizer.decide): the open configuration with the largest chance per
    GPU-second to beat the bar (the launch `bar`, as the model sees it, where the incumbent pays;
    else the baseline) by more than `gain`, and the model's misfit factor (host offsets taken out).

    With `launch_var` (a launch's noise variance: `stop_rules.launch_variance`), the chance that
    one launch of it moves the model's estimate past the bar by more than `gain`
    (optimizer.gains.moved_sd): the study's answer is the model's, so that is the chance that a
    launch changes the answer."""
    levels, weights = objective_levels(spec)
    recs = A.records(measured)
    mcfg = [r.config for r in recs]
    mean_m, sd_m = model.predict_log_speedup(Candidates.of(mcfg), levels, weights)
    got = np.log(np.maximum([float(t.value or 0.0) for t in measured], 1e-9))
    # A believed launch (optimizer.believer) lies on the fit by construction: it would only shrink
    # the misfit, so the misfit is the real results' alone.
    real = np.array([not r.has(A.BELIEVED) for r in recs])
    misfit = host_misfit(
        (got - mean_m)[real],
        np.sqrt(sd_m**2 + 0.01**2)[real],
        [r.worker_id for r in recs if not r.has(A.BELIEVED)],
        policy.host_sd,
    )
    if not op.configs:
        return None, misfit
    if best_value > 1.0:
        # Against the bar as the model sees it (its fit of every measurement), so what is
        # uncertain for both alike cancels.
        diff, sd = gain_over(spec, model, op.configs, bar, floor_sd)
    else:
        # Of the value itself where a launch's noise is added below (`moved_sd`), else of a
        # measurement of a new launch (the host offset and launch noise the model's residuals show).
        diff, sd = model.predict_log_speedup(Candidates.of(op.configs), levels, weights, new_launch=launch_var is None)
    chance = norm.cdf(beat_z(diff, sd * misfit, gain, launch_var)) * (1.0 - op.p_fail)
    if policy.per_cost:
        speed, _ = model.predict_log_speedup(Candidates.of(op.configs), levels, weights, with_sd=False)
        cost = decide.prices(spec, trials, policy).relative(op.configs, np.exp(speed), op.p_fail)
    else:
        cost = np.ones(len(op.configs))
    i = int(np.argmax(chance / cost))
    return decide.Move(decide.Purpose.SEARCH, op.configs[i].key, float(chance[i]), float(cost[i])), misfit
