"""Confirmation: re-measure the top candidates next to a fresh baseline, and say what it means.

When the search budget is used, the few best configurations are measured again, each on a worker
right after that worker measured a fresh baseline (a baseline lease on the same host just
before the confirm lease; the worker runs one server at a time, so "next to" means the
baseline is the last thing that host measured before the candidate).  Drift and host offsets
then cancel in the ratio, and the winner is the candidate with the best confirmed objective,
reported with the 95% interval of its confirmation (delta method on the log ratio of the
repeated passes, `optimizer.analysis`).

Only candidates within `CANDIDATE_WINDOW` of the best measured value are confirmed: one that far
behind cannot overtake the best on a re-measurement, and each confirmation is a restart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from optuna.trial import FrozenTrial

from optimizer import attrs as A
from optimizer.analysis import (
    Z95,
    Interval,
    LaunchNoise,
    Relaunch,
    launch_noise,
    log_mean_variance,
)
from optimizer.objective import objective_intervals, objective_view, score_levels
from optimizer.policy import DEFAULT_POLICY
from optimizer.space import SpecConfig
from optimizer.spec import Objective, StudySpec

CANDIDATE_WINDOW = DEFAULT_POLICY.candidate_window  # optimizer.policy


def search_interval(spec: StudySpec, t: FrozenTrial, extra_var: float = 0.0) -> Interval | None:
    """The 95% interval of a trial's objective as measured in the search."""
    r = A.TrialRecord(t)
    ivs = objective_intervals(spec.objective, r.levels, r.baseline_levels, extra_var)
    return objective_interval(spec, float(r.value or 0.0), ivs, extra_var)


def study_relaunches(
    trials: Sequence[FrozenTrial],
    baselines: Sequence[tuple[str, Sequence[Mapping[str, Any]]]],
    confirmations: Sequence[tuple[str, Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]]],
    objective: Objective | None = None,
) -> list[Relaunch]:
    """The re-launches a study made anyway, as `launch_noise` reads them.

    `baselines`: (host, levels) of every baseline launch of the study's baseline server;
    `confirmations`: (configuration key, levels, paired baseline levels) of every completed
    confirmation.  Each host's baselines group by level (x2: a speedup holds two launches);
    each configuration's speedups (search and confirmations) group by level.  Saturated levels
    say nothing about launches and are left out.  `objective`: read each level's figure of it
    (`objective.objective_view`); None reads output tok/s.
    """

    def view(levels: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
        return levels if objective is None else objective_view(objective, levels)

    out: list[Relaunch] = []
    for host, levels in baselines:
        for lv in view(levels):
            runs = lv.get("output_tok_s_runs") or []
            w = log_mean_variance(runs)
            if w is not None and not lv.get("saturated"):
                out.append(Relaunch(f"base:{host}:{int(lv['concurrency'])}", float(lv["output_tok_s"]), w, 2.0))
    speedups: list[tuple[str, Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]]] = [
        (r.config_key, view(r.levels), view(r.baseline_levels))
        for r in A.records(A.measured_feasible(trials, A.LEVELS))
        if r.config_key and r.baseline_levels
    ]
    for key, levels, base_levels in [*speedups, *((k, view(lv), view(b)) for k, lv, b in confirmations)]:
        base = {int(b["concurrency"]): b for b in base_levels}
        for lv in levels:
            b = base.get(int(lv["concurrency"]))
            if b is None or lv.get("saturated") or b.get("saturated"):
                continue
            vt, vb = (
                log_mean_variance(lv.get("output_tok_s_runs") or []),
                log_mean_variance(b.get("output_tok_s_runs") or []),
            )
            if vt is None or vb is None or not b["output_tok_s"] or not lv["output_tok_s"]:
                continue
            ratio = float(lv["output_tok_s"]) / float(b["output_tok_s"])
            out.append(Relaunch(f"speedup:{key}:{int(lv['concurrency'])}", ratio, vt + vb, 1.0))
    return out


def study_noise(
    trials: Sequence[FrozenTrial],
    baselines: Sequence[tuple[str, Sequence[Mapping[str, Any]]]],
    confirmations: Sequence[tuple[str, Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]]],
    objective: Objective | None = None,
) -> LaunchNoise:
    """The study's launch-to-launch noise (`optimizer.analysis.launch_noise`) from its own re-launches."""
    return launch_noise(study_relaunches(trials, baselines, confirmations, objective))


def overlaps(a: Interval | None, b: Interval | None, value_a: float, value_b: float) -> bool:
    """Could the two be in either order?  Without intervals: within CANDIDATE_WINDOW."""
    if a is None or b is None:
        return value_a >= value_b * (1.0 - CANDIDATE_WINDOW)
    return a.high >= b.low and b.high >= a.low


# A runner-up is confirmed only when its chance of beating the leader by more than min_gain is at
# least this (the stop rule's risk, optimizer.convergence.P_MATTERS): otherwise choosing the
# leader without it keeps within what the study promises, and each confirmation is a restart
# (and, on a host without a fresh baseline, a baseline too).
RUNNER_UP_CHANCE = DEFAULT_POLICY.runner_up_chance  # optimizer.policy


def beat_chance(leader: Interval, other: Interval, min_gain: float) -> float:
    """The chance that `other` truly beats `leader` by more than `min_gain`, from their values and
    95% intervals (normal on the log scale)."""
    sd = math.hypot(log_sd(leader), log_sd(other))
    d = math.log(other.value / leader.value) - math.log1p(min_gain)
    if sd <= 0:
        return 1.0 if d > 0 else 0.0
    return float(0.5 * math.erfc(-d / (sd * math.sqrt(2))))


class RunnerUps(Protocol):
    """The study's model of every launch, where it is trusted (optimizer.ranking.Ranking)."""

    def estimate(self, config: SpecConfig) -> float: ...

    def beat_chance(self, config: SpecConfig, best: SpecConfig, min_gain: float) -> float: ...


def candidates(
    trials: Sequence[FrozenTrial],
    top: int,
    spec: StudySpec | None = None,
    extra_var: float = 0.0,
    ranking: RunnerUps | None = None,
) -> list[FrozenTrial]:
    """The distinct configurations worth confirming, best measured first (at most `top`).

    With the spec, only the runners-up that may beat the leader by more than `min_gain` with a
    chance of at least RUNNER_UP_CHANCE (their search intervals, widened by the launch noise
    `extra_var`): one that cannot changes no answer the study stands behind, and each
    confirmation is a restart.  With a `ranking` (the study's model of every launch, trusted where
    its predictions held, optimizer.ranking) the model judges instead: a runner-up is confirmed
    when the model gives it that chance (it pools every launch, so it is far surer of a difference
    than two launches' intervals are) or ranks it above the leader (the leader's one search launch
    may be its luckiest, and `choose` asks the same ranking which is best).
    """
    if top <= 0:
        return []
    ranked = sorted(A.measured_feasible(trials, A.CONFIG, A.LEVELS), key=lambda t: (-float(t.value or 0.0), t.number))
    out: list[FrozenTrial] = []
    seen: set[str] = set()
    lead_iv: Interval | None = None
    for t in ranked:
        key = str(A.TrialRecord(t).config_key)
        if key in seen:
            continue
        if out and float(t.value or 0.0) < float(out[0].value or 0.0) * (1.0 - CANDIDATE_WINDOW):
            break
        if spec is not None:
            iv = search_interval(spec, t, extra_var)
            if not out:
                lead_iv = iv
            elif ranking is not None:
                cfg, lead_cfg = A.TrialRecord(t).config, A.TrialRecord(out[0]).config
                if ranking.beat_chance(cfg, lead_cfg, spec.budget.min_gain) < RUNNER_UP_CHANCE and ranking.estimate(
                    cfg
                ) <= ranking.estimate(lead_cfg):
                    continue
            elif lead_iv is None or iv is None:
                if not overlaps(iv, lead_iv, float(t.value or 0.0), float(out[0].value or 0.0)):
                    continue
            elif beat_chance(lead_iv, iv, spec.budget.min_gain) < RUNNER_UP_CHANCE:
                continue
        seen.add(key)
        out.append(t)
        if len(out) >= top:
            break
    return out


def baseline_serves(
    baseline_at: float,
    confirmation_began: float,
    last_search_done_on_host: float | None,
    last_confirm_done_on_host: float | None,
    drift_seen: bool,
) -> bool:
    """May a host's latest baseline pair with its next confirmation (times in any one clock)?

    One fresh baseline serves every confirmation on that host: measured after the confirmation
    phase began, or before it with no search launch of the study on the host since (a host the
    search left idle measured it while the last launches flew; how long before, the caller's
    freshness test bounds: optimizer.conductor.baseline_fresh).  Only where drift was seen must a
    new baseline follow each candidate (baseline-candidate-baseline), i.e. be measured after the
    host's previous confirmation.
    """
    if baseline_at < confirmation_began and last_search_done_on_host is not None:
        if last_search_done_on_host > baseline_at:
            return False
    if drift_seen and last_confirm_done_on_host is not None:
        return baseline_at >= last_confirm_done_on_host
    return True


def drift_seen(fresh: Sequence[Mapping[str, Any]], earlier: Sequence[Mapping[str, Any]], margin: float) -> bool:
    """Did the host's baseline move by more than `margin` (relative) between two measurements?"""
    a = {int(b["concurrency"]): float(b["output_tok_s"]) for b in fresh if b.get("output_tok_s")}
    b = {int(x["concurrency"]): float(x["output_tok_s"]) for x in earlier if x.get("output_tok_s")}
    return any(abs(a[c] / b[c] - 1.0) > margin for c in a.keys() & b.keys() if b[c] > 0)


@dataclass(frozen=True)
class Confirmed:
    """One candidate's re-measurement against the baseline measured right before it."""

    value: float
    interval: Interval | None
    speedup_by_level: dict[int, float]
    intervals_by_level: dict[int, Interval]
    violation: float
    # Confirmation launches pooled into it (`pooled_result`), each against its own paired baseline.
    launches: int = 1

    def as_json(self) -> dict[str, Any]:
        return {
            "launches": self.launches,
            "speedup": self.value,
            "speedup_interval": None if self.interval is None else _iv(self.interval),
            "speedup_by_level": {str(k): v for k, v in self.speedup_by_level.items()},
            "speedup_interval_by_level": {str(k): _iv(v) for k, v in self.intervals_by_level.items()},
            "violation": self.violation,
        }


def _iv(iv: Interval) -> dict[str, float]:
    return {"low": iv.low, "high": iv.high}


def confirm_result(
    spec: StudySpec,
    levels: Sequence[Mapping[str, Any]],
    baseline_levels: Sequence[Mapping[str, Any]],
    extra_var: float = 0.0,
) -> Confirmed:
    """The objective and its interval from one confirm measurement and its paired baseline.

    `extra_var`: the study's launch-to-launch noise (`study_noise`), which one launch cannot show.
    """
    sc = score_levels(spec.objective, levels, baseline_levels)
    ivs = objective_intervals(spec.objective, levels, baseline_levels, extra_var)
    return Confirmed(sc.value, objective_interval(spec, sc.value, ivs, extra_var), sc.speedups, ivs, sc.violation)


def pooled_result(
    spec: StudySpec,
    measurements: Sequence[tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]]],
    extra_var: float = 0.0,
) -> Confirmed:
    """One configuration's confirmation launches pooled: each (levels, paired baseline levels) is
    read as `confirm_result`, and their log speedups are averaged with inverse-variance weights
    (each interval holds its own launch's noise, `extra_var`, so they are independent).

    Only confirmations are pooled, never the search launch: a leader's search launch is its
    luckiest by selection (pooling it dropped coverage, benchmarks/README.md).  Without an interval
    on every launch the latest launch stands alone.
    """
    got = [confirm_result(spec, lv, base, extra_var) for lv, base in measurements]
    if not got:
        raise ValueError("no confirmation to pool")
    if len(got) == 1 or any(g.interval is None for g in got):
        return got[-1]
    value, interval = _pool([(g.value, g.interval) for g in got])
    levels = set.intersection(*(set(g.speedup_by_level) & set(g.intervals_by_level) for g in got))
    by_level = {c: _pool([(g.speedup_by_level[c], g.intervals_by_level[c]) for g in got]) for c in sorted(levels)}
    return Confirmed(
        value,
        interval,
        {c: v for c, (v, _) in by_level.items()},
        {c: iv for c, (_, iv) in by_level.items() if iv is not None},
        max(g.violation for g in got),
        len(got),
    )


def _pool(parts: Sequence[tuple[float, Interval | None]]) -> tuple[float, Interval | None]:
    """Inverse-variance mean of log values with 95% intervals (the latest alone if one has no spread)."""
    sds = [log_sd(iv) if iv is not None and v > 0 else 0.0 for v, iv in parts]
    if any(sd <= 0 for sd in sds):
        return parts[-1]
    w = [1.0 / sd**2 for sd in sds]
    mean = sum(wi * math.log(v) for wi, (v, _) in zip(w, parts, strict=True)) / sum(w)
    half = Z95 / math.sqrt(sum(w))
    value = math.exp(mean)
    return value, Interval(value, math.exp(mean - half), math.exp(mean + half))


def objective_interval(
    spec: StudySpec, value: float, ivs: Mapping[int, Interval], extra_var: float = 0.0
) -> Interval | None:
    """Interval of the objective: one level's, or the geometric mean's.

    The passes of different levels are independent, but a launch moves every level of it alike:
    the `extra_var` part each level's interval holds is added back as fully correlated.
    """
    if spec.objective.concurrency is not None:
        return ivs.get(spec.objective.concurrency)
    levels = spec.workload.concurrency
    if value <= 0 or any(level not in ivs for level in levels):
        return None
    var = sum((math.log(ivs[c].high / ivs[c].low) / (2 * Z95)) ** 2 for c in levels) / len(levels) ** 2
    var += extra_var * (1.0 - 1.0 / len(levels))
    half = Z95 * math.sqrt(var)
    return Interval(value, value * math.exp(-half), value * math.exp(half))


def pays(value: float | None, interval: Interval | None) -> bool:
    """Does speculation beat the baseline: the interval above 1.0, or (without a spread) the value."""
    if value is None:
        return False
    if interval is not None:
        return interval.low > 1.0
    return value > 1.0


def saturated_levels(*level_lists: Sequence[Mapping[str, Any]] | None) -> dict[int, str]:
    """The levels marked saturated (workers/loadgen/saturation.py) in any of these measurements, with why."""
    out: dict[int, str] = {}
    for levels in level_lists:
        for lv in levels or []:
            if lv.get("saturated"):
                out.setdefault(int(lv["concurrency"]), str(lv["saturated"]))
    return out


def verdict(
    value: float | None,
    interval: Interval | None,
    *,
    label: str,
    measured: int,
    confirmed: bool,
    where: str = "",
    saturated: Mapping[int, str] | None = None,
    fresh: bool = True,
    metric: str = "output throughput",
    not_independent: str | None = None,
) -> str:
    """The one-line answer.  Says "speculation does not pay here" unless the interval clears 1.

    `metric`: what the study is judged by (`objective.metric_words`), named in the answer's first words.

    A result resting on a saturated level is no answer: the verdict says so and why.
    `fresh`: the confirmation's baseline was one measured for it; "fresh" is said only then.
    `not_independent`: why the re-measurement is no confirmation (the token that found it measured it).
    """
    if value is None:
        return "no result yet"
    if saturated:
        c, why = min(saturated.items())
        return (
            f"no answer on {metric}: {label} read {value:.3f}x, but the measurement at concurrency "
            f"{', '.join(map(str, sorted(saturated)))} is saturated ({why}); that figure is the host's load, "
            "not the configuration's: measure on a host with room (fewer tenants, or a slower simulated engine)"
        )
    band = "" if interval is None else f" (95% interval {interval.low:.3f}-{interval.high:.3f})"
    if not_independent is not None:
        # Never "confirmed": no second token vouches for it (issue 35).
        how = f"{not_independent}; no second worker token vouches for it"
    elif confirmed and fresh:
        how = f"confirmed against a fresh baseline{where}"
    elif confirmed:
        how = f"re-measured{where} against that host's latest baseline, which was not measured for it"
    else:
        how = "measured once in the search, not yet confirmed against a fresh baseline"
    if pays(value, interval) and interval is not None:
        return f"speculation pays on {metric}: {label} runs at {value:.3f}x the baseline{band}, {how}"
    if pays(value, interval):
        return f"speculation pays on {metric}: {label} runs at {value:.3f}x the baseline ({how}; no spread to bound it)"
    if value > 1.0:
        evidence = f"its {value:.3f}x{band} does not clear 1.0 beyond noise"
    else:
        evidence = f"it reaches only {value:.3f}x the baseline{band}"
    return (
        f"speculation does not pay here on {metric}: the best of {measured} configurations measured is {label}, and "
        f"{evidence} ({how}); run without speculation"
    )


def cost_key(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """How much a configuration costs to run: tokens verified per step, then draft work, then depth.

    Fewer draft tokens mean less verify compute per batch and smaller graphs (docs/sglang.md
    §13); steps x topk is the draft's work per step.
    """
    steps, topk, tokens = int(config["num_steps"]), int(config["topk"]), int(config["num_draft_tokens"])
    return tokens, steps * topk, steps


@dataclass(frozen=True)
class Choice:
    """The answer among confirmed candidates: the cheapest of those tied with the best."""

    winner: Mapping[str, Any]
    best: Mapping[str, Any]  # the highest confirmed value, or the best by the study's model
    ties: list[Mapping[str, Any]]  # the others the winner cannot be told apart from
    ranked: bool = False  # the study's model ordered them (optimizer.ranking), not the confirmations alone

    @property
    def note(self) -> str | None:
        if not self.ties:
            return None
        others = ", ".join(label(c) for c in self.ties)
        if self.winner is self.best:
            cheaper = [c for c in self.ties if cost_key(c["config"]) < cost_key(self.best["config"])]
            if cheaper:
                if self.ranked:
                    return (
                        f"ties with {others} (overlapping 95% intervals); the study's model of every launch "
                        f"ranks it first and cannot show that the cheaper {label(cheaper[0])} gives up less than "
                        "min_gain, so it is the answer"
                    )
                return (
                    f"ties with {others} (overlapping 95% intervals); the cheaper {label(cheaper[0])} "
                    f"may be more than min_gain behind (a {100 * TIE_RISK:.0f}% chance or more), so the best "
                    "measured is the answer"
                )
            return f"ties with {others} (overlapping 95% intervals); it is also the cheapest of them"
        return f"ties with {others} (overlapping 95% intervals): the cheapest of the tied configurations is the answer"


def label(c: Mapping[str, Any]) -> str:
    """A confirmed candidate in words: steps/topk/draft tokens at its speedup."""
    cfg = c["config"]
    return f"{cfg['num_steps']}/{cfg['topk']}/{cfg['num_draft_tokens']} at {float(c['speedup']):.3f}x"


def _interval_of(c: Mapping[str, Any]) -> Interval | None:
    iv = c.get("speedup_interval")
    return None if iv is None else Interval(float(c["speedup"]), float(iv["low"]), float(iv["high"]))


# The risk the answer may take of being more than min_gain below the best confirmed candidate
# for being cheaper: the stop rule's (optimizer.convergence.P_MATTERS), so the tie rule does not
# spend what the stop rule promised.
TIE_RISK = DEFAULT_POLICY.tie_risk  # optimizer.policy


def log_sd(iv: Interval) -> float:
    """The sd on the log scale a 95% interval stands for (0 without a spread)."""
    return math.log(iv.high / iv.low) / (2 * Z95) if iv.low > 0 and iv.high > iv.low else 0.0


def behind_risk(best: Mapping[str, Any], other: Mapping[str, Any], min_gain: float) -> float:
    """The chance that `other` is truly more than `min_gain` below `best`, from their confirmed
    values and 95% intervals (normal on the log scale; 1.0 without intervals)."""
    a, b = _interval_of(best), _interval_of(other)
    if a is None or b is None:
        return 1.0
    sd = math.hypot(log_sd(a), log_sd(b))
    d = math.log(float(best["speedup"]) / float(other["speedup"])) - math.log1p(min_gain)
    if sd <= 0:
        return 1.0 if d > 0 else 0.0
    return float(0.5 * math.erfc(-d / (sd * math.sqrt(2))))


class Ranking(Protocol):
    """Which candidate is best on everything the study measured (optimizer.ranking.Ranking)."""

    def estimate(self, config: SpecConfig) -> float: ...

    def surely_within(self, config: SpecConfig, best: SpecConfig, min_gain: float) -> bool: ...


def _ranking_value(c: Mapping[str, Any]) -> float:
    """What a candidate is ranked by without the study's model: its confirmed value and, where the
    document carries it, its search measurement too (the geometric mean: two launches of the same
    server, each against a baseline of its own host, so the ranking is not one launch's luck)."""
    v = float(c["speedup"])
    s = c.get("search_speedup")
    return math.sqrt(v * float(s)) if isinstance(s, int | float) and s > 0 and v > 0 else v


# How sure two launches each must make it that a candidate beats another by more than min_gain
# before they overrule the study's model (one-sided 80%).  Measured between two cases
# (benchmarks/README.md, "Answer quality"): two-peaks seed 12, where a model fitting one regime
# rated a chain level with the tree that beat it by ~2% twice (z 0.99: overruled, rightly), and
# small-gain seed 3, where a lucky and an unlucky pair of launches put a 1.3%-worse candidate
# 2.2% ahead against the model's right order (z 0.74: the model stands).
OVERRULE_Z = DEFAULT_POLICY.overrule_z  # optimizer.policy


def _measured_better(a: Mapping[str, Any], b: Mapping[str, Any], min_gain: float) -> bool:
    """`a` measured more than `min_gain` above `b` on two launches each, its confirmation and its
    search launch, by more than their noise explains (`OVERRULE_Z`, on the confirmations' own
    intervals, a search launch as noisy as one confirmation launch).  Smaller gaps are the launch
    noise the model's ranking is there to see through."""
    sa, sb = a.get("search_speedup"), b.get("search_speedup")
    if not isinstance(sa, int | float) or not isinstance(sb, int | float) or sa <= 0 or sb <= 0:
        return False
    bar = 1.0 + min_gain
    if not (float(a["speedup"]) > float(b["speedup"]) * bar and float(sa) > float(sb) * bar):
        return False
    ia, ib = _interval_of(a), _interval_of(b)
    if ia is None or ib is None:
        return True
    # The mean of the two log differences; a pooled confirmation's interval is over its launches.
    va, vb = log_sd(ia) ** 2, log_sd(ib) ** 2
    na, nb = int(a.get("launches") or 1), int(b.get("launches") or 1)
    sd = math.sqrt(va + vb + va * na + vb * nb) / 2
    d = (math.log(float(a["speedup"]) / float(b["speedup"])) + math.log(float(sa) / float(sb))) / 2
    return d - math.log1p(min_gain) > OVERRULE_Z * sd


def choose(confirmed: Sequence[Mapping[str, Any]], min_gain: float = 0.01, ranking: Ranking | None = None) -> Choice:
    """The best confirmed candidate, or the cheapest one tied with it.

    Best: by `ranking` where there is one, else by the confirmed value and, where the documents
    carry it (`search_speedup`), the search's measurement of the same server too
    (`_ranking_value`): a runner-up's one lucky confirmation does not displace a leader measured
    well twice.  Either way, never one that another candidate measured more than `min_gain`
    better on both its launches (search and confirmation).
    Tied: the intervals overlap (the data cannot order them); the verdict says so.  Entries are
    confirmation documents (`speedup`, `speedup_interval`, `config`, `trial_number`).  Without
    intervals nothing is tied.

    `ranking` (optimizer.ranking.of: the study's model of every launch, where it is trusted):
    which candidate is best is its call, not one confirmation launch's, and a cheaper tied one is
    preferred only when measured within `min_gain` of the best and the ranking is sure
    (optimizer.ranking.WITHIN_Z) that it gives up less than `min_gain`.  Without one, the cheapest
    tied candidate is the answer only when the chance that it is more than `min_gain` below the
    best (the study's "worth having") is under `TIE_RISK`; a cheaper one that may well be further
    behind is not given the benefit of the doubt.
    """
    if not confirmed:
        raise ValueError("nothing confirmed to choose from")

    def config(c: Mapping[str, Any]) -> SpecConfig:
        return SpecConfig.model_validate(c["config"])

    def rank(c: Mapping[str, Any]) -> float:
        return _ranking_value(c) if ranking is None else ranking.estimate(config(c))

    # The model orders near-equal candidates, but does not overrule two launches: a candidate
    # that another beat by more than min_gain in both its search launch and its confirmation is
    # not the best (a model that fits one regime of an engine can rate the other one level with it).
    open_ = [c for c in confirmed if not any(_measured_better(o, c, min_gain) for o in confirmed if o is not c)]
    best = max(open_ or confirmed, key=lambda c: (rank(c), -int(c["trial_number"])))
    best_iv = _interval_of(best)
    tied = [
        c
        for c in confirmed
        if c is not best
        and best_iv is not None
        and (iv := _interval_of(c)) is not None
        and iv.high >= best_iv.low
        and best_iv.high >= iv.low
    ]
    close = [
        c
        for c in tied
        if (
            float(c["speedup"]) >= float(best["speedup"]) / (1.0 + min_gain)
            and ranking.surely_within(config(c), config(best), min_gain)
            if ranking is not None
            else behind_risk(best, c, min_gain) < TIE_RISK
        )
    ]
    winner = min([best, *close], key=lambda c: (cost_key(c["config"]), -float(c["speedup"])))
    return Choice(winner, best, [c for c in [best, *tied] if c is not winner], ranking is not None)


# Extra passes on the warm server per level, as a multiple of the workload's repeats: the cost
# cap of resolving one confirmation (stated in the lease and in `cost`).
EXTRA_PASSES_PER_REPEAT = DEFAULT_POLICY.extra_passes_per_repeat  # optimizer.policy


# Hosts whose baselines of the same server differ by more than this share, and beyond their
# noise, are not measuring the same thing: one is likely saturated (issue 17 item 6).
HOST_DISAGREEMENT = DEFAULT_POLICY.host_disagreement  # optimizer.policy


def host_disagreement(latest: Mapping[str, Sequence[Mapping[str, Any]]], launch_var: float = 0.0) -> str | None:
    """Do hosts' latest baselines of the study's server disagree beyond the noise seen?

    `latest`: host -> its latest baseline levels.  Host offsets cancel in a speedup when they
    scale every rate alike; a host that cannot keep up does not (its speedups come out
    bimodal), so a gap larger than HOST_DISAGREEMENT and than 3 sd of the passes' and launches'
    noise is reported, naming the hosts, the level and the rates.
    """
    by_level: dict[int, list[tuple[str, float, float]]] = {}
    for host, levels in latest.items():
        for lv in levels:
            w = log_mean_variance(lv.get("output_tok_s_runs") or [])
            if w is None or lv.get("saturated") or float(lv["output_tok_s"]) <= 0:
                continue
            by_level.setdefault(int(lv["concurrency"]), []).append((host, float(lv["output_tok_s"]), w))
    worst: tuple[float, int, tuple[str, float], tuple[str, float]] | None = None
    for c, rows in by_level.items():
        if len(rows) < 2:
            continue
        lo, hi = min(rows, key=lambda r: r[1]), max(rows, key=lambda r: r[1])
        gap = math.log(hi[1] / lo[1])
        sd = math.sqrt(lo[2] + hi[2] + launch_var)
        if gap > math.log1p(HOST_DISAGREEMENT) and gap > 3 * sd and (worst is None or gap > worst[0]):
            worst = (gap, c, (lo[0], lo[1]), (hi[0], hi[1]))
    if worst is None:
        return None
    _, c, (h_lo, v_lo), (h_hi, v_hi) = worst
    return (
        f"hosts disagree: the baseline at concurrency {c} ran at {v_lo:,.0f} tok/s on {h_lo} and {v_hi:,.0f} on "
        f"{h_hi}, beyond the noise either showed; one of them is probably saturated (a busy host or load "
        "generator), and speedups measured on them are not comparable"
    )
