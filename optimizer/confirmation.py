"""Confirmation: re-measure the top candidates next to a fresh baseline (which one is the answer,
and what it means: optimizer.answer).

When the search budget is used, the few best configurations are measured again, each on a worker
right after that worker measured a fresh baseline (a baseline lease on the same host just
before the confirm lease; the worker runs one server at a time, so "next to" means the
baseline is the last thing that host measured before the candidate).  Drift and host offsets
then cancel in the ratio, and each confirmation is reported with its 95% interval (delta method
on the log ratio of the repeated passes, `optimizer.analysis`).

Only runners-up with a chance of `p_matters` (the study's policy) to beat the best by `min_gain`
are confirmed: one that cannot changes no answer the study stands behind, and each confirmation is
a restart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from optuna.trial import FrozenTrial

from optimizer import attrs as A
from optimizer import decide
from optimizer.analysis import (
    Z95,
    Interval,
    LaunchNoise,
    Relaunch,
    launch_noise,
    log_mean_variance,
)
from optimizer.gains import moved_sd
from optimizer.objective import objective_intervals, objective_view, score_levels
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.space import SpecConfig
from optimizer.spec import Objective, StudySpec


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
    policy: Policy = DEFAULT_POLICY,
) -> LaunchNoise:
    """The study's launch-to-launch noise (`optimizer.analysis.launch_noise`) from its own
    re-launches, with the prior and floor of its `policy`."""
    return launch_noise(study_relaunches(trials, baselines, confirmations, objective), policy)


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
    policy: Policy = DEFAULT_POLICY,
) -> list[FrozenTrial]:
    """The distinct configurations worth confirming, best first (at most `top`): by the model's
    estimate where a trusted `ranking` is given, else by measured value.

    With the spec, only the runners-up that may beat the leader by more than `min_gain` with a
    chance of at least `policy.p_matters` (their search intervals, widened by the launch noise
    `extra_var`): one that cannot changes no answer the study stands behind, and each
    confirmation is a restart.  With a `ranking` (the study's model of every launch, trusted where
    its predictions held, optimizer.ranking) the model judges instead: the leader is the launched
    configuration it ranks first (the best measured may owe its place to one lucky launch, or to
    its host's baseline: `choose` asks the same ranking which is best), and a runner-up is
    confirmed when the model gives it that chance to beat the leader (it pools every launch, so
    it is far surer of a difference than two launches' intervals are).

    A runner-up without a search interval (no passes to judge a chance by) is not confirmed, as
    `answer.choose` calls nothing tied without intervals.  Until stop 44 a `candidate_window` (5%
    of the leader) also bounded them; it decided nothing the chance did not (family engines 0-199
    line for line the same at 100%: benchmarks/README.md "The candidate window, measured (stop
    44)").

    The case that fails without the runners-up (the leader alone confirmed, as `confirmation.top` 1
    does; measured while the best measured led):
    family engine 39 (seed 39) answers 0.9470 of the fleet's optimum instead of 0.9975, and family
    engine 10 (seed 10) 0.9685 instead of 1.0000 in 16 launches instead of 13; on engines 0-39 the
    answers within 2% on the fleet fall from 38/40 to 31/40 (benchmarks/README.md "Rules measured
    off on the family (stop 41)").
    """
    if top <= 0:
        return []
    measured = A.measured_feasible(trials, A.CONFIG, A.LEVELS)
    # With a ranking, the model's estimate orders them: every launch of one host is divided by
    # that host's one baseline, whose launch noise (and the host's offset) moves them all
    # together, and the model's per-host offsets take that out where the raw values cannot (on
    # family engine 36 a host's baseline drawn high put the optimum fourth by value, out of `top`).
    score = {
        id(t): ranking.estimate(A.TrialRecord(t).config) if ranking is not None else float(t.value or 0.0)
        for t in measured
    }
    ranked = sorted(measured, key=lambda t: (-score[id(t)], t.number))
    # Each runner-up is a move (optimizer.decide): its chance to beat the leader by min_gain, per
    # its launch's GPU-seconds (it pairs with the leader's fresh baseline on its host).
    costs: dict[int, float] = {}
    if spec is not None and len(ranked) > 1:
        cfgs = [A.TrialRecord(t).config for t in ranked]
        rel = decide.prices(spec, trials, policy).relative(cfgs, np.array([score[id(t)] for t in ranked]))
        costs = {id(t): float(c) for t, c in zip(ranked, rel, strict=True)}
    out: list[FrozenTrial] = []
    seen: set[str] = set()
    lead_iv: Interval | None = None
    for t in ranked:
        key = str(A.TrialRecord(t).config_key)
        if key in seen:
            continue
        if spec is not None:
            iv = search_interval(spec, t, extra_var)
            if not out:
                lead_iv = iv
            elif ranking is not None:
                # Ordered by the model, no runner-up ranks above the leader: its chance decides.
                cfg, lead_cfg = A.TrialRecord(t).config, A.TrialRecord(out[0]).config
                chance = ranking.beat_chance(cfg, lead_cfg, spec.budget.min_gain)
                if not decide.worth(decide.Move(decide.Purpose.RUNNER_UP, key, chance, costs[id(t)]), policy):
                    continue
            elif lead_iv is None or iv is None:
                continue
            else:
                chance = beat_chance(lead_iv, iv, spec.budget.min_gain)
                if not decide.worth(decide.Move(decide.Purpose.RUNNER_UP, key, chance, costs[id(t)]), policy):
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


def drift_seen(
    fresh: Sequence[Mapping[str, Any]], earlier: Sequence[Mapping[str, Any]], launch_var: float, z: float = Z95
) -> bool:
    """Did the host's baseline move between two measurements by more than their noise explains?

    Moved: at some level by more than `z` sd of the two launches' noise (`launch_var`, the study's
    launch-to-launch variance of a speedup's log, `study_noise`: a speedup divides two launches,
    as this difference does) and of their passes (`log_mean_variance` of each baseline's passes).
    A re-launch of an unchanged server moves its throughput by that noise alone; a fixed 2% read
    it as drift, and every confirmation then measured its own baseline (issue 31).
    """
    a = {int(b["concurrency"]): b for b in fresh if b.get("output_tok_s")}
    b = {int(x["concurrency"]): x for x in earlier if x.get("output_tok_s")}
    for c in a.keys() & b.keys():
        va, vb = float(a[c]["output_tok_s"]), float(b[c]["output_tok_s"])
        if va <= 0 or vb <= 0:
            continue
        passes = sum(log_mean_variance(x[c].get("output_tok_s_runs") or []) or 0.0 for x in (a, b))
        if abs(math.log(va / vb)) > z * math.sqrt(passes + launch_var):
            return True
    return False


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


def saturated_levels(*level_lists: Sequence[Mapping[str, Any]] | None) -> dict[int, str]:
    """The levels marked saturated (workers/loadgen/saturation.py) in any of these measurements, with why."""
    out: dict[int, str] = {}
    for levels in level_lists:
        for lv in levels or []:
            if lv.get("saturated"):
                out.setdefault(int(lv["concurrency"]), str(lv["saturated"]))
    return out


def log_sd(iv: Interval) -> float:
    """The sd on the log scale a 95% interval stands for (0 without a spread)."""
    return math.log(iv.high / iv.low) / (2 * Z95) if iv.low > 0 and iv.high > iv.low else 0.0


def clear_chance(iv: Interval, launches: int) -> float:
    """The chance that one more launch, pooled with the `launches` behind `iv`, lifts its 95%
    interval above 1.0 (the verdict "pays", optimizer.answer.clears).

    The preposterior of the stop rule (optimizer.gains.moved_sd), asked of the verdict: one launch
    of the variance the pooled interval implies for each of its launches (n sd²) moves the pooled
    log-value by a normal of sd sd/sqrt(n+1) and leaves it held with sd sd·sqrt(n/(n+1)).  Where the
    interval is mostly a launch's own passes or the value sits at or below 1.0, that chance is small,
    so one rule replaces "straddles with the value above 1.0" and "launch noise is half of it"."""
    sd = log_sd(iv)
    if sd <= 0.0 or iv.value <= 0.0:
        return 0.0
    n = max(launches, 1)
    after = sd * math.sqrt(n / (n + 1))
    moved = float(moved_sd(np.array(sd), n * sd * sd))  # = sd/sqrt(n+1)
    return 0.5 * math.erfc(-(math.log(iv.value) - Z95 * after) / (moved * math.sqrt(2.0)))


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
