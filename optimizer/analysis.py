"""What a result means: the speedup with its uncertainty, from the repeated passes."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optimizer.policy import DEFAULT_POLICY, Policy

# 95% two-sided normal quantile; with 3-5 repeats this is a readable, slightly optimistic band.
Z95 = 1.96


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float

    @property
    def half_width_pct(self) -> float:
        return 100.0 * (self.high - self.low) / 2.0 / self.value if self.value else 0.0


def log_mean_variance(runs: Sequence[float]) -> float | None:
    """Variance of log(mean(runs)) from the spread of the passes; None with fewer than two."""
    if len(runs) < 2:
        return None
    m = statistics.fmean(runs)
    if m <= 0:
        return None
    return (statistics.variance(runs) / m**2) / len(runs)


def ratio_interval(
    trial_runs: Sequence[float], base_runs: Sequence[float], z: float = Z95, extra_var: float = 0.0
) -> Interval | None:
    """Interval for mean(trial)/mean(base) by the delta method on the log ratio.

    `extra_var`: variance of the log ratio that the passes of one launch cannot show (launch to
    launch, host to host; `launch_noise`).  None when either side has fewer than two passes.
    """
    vt, vb = log_mean_variance(trial_runs), log_mean_variance(base_runs)
    if vt is None or vb is None:
        return None
    r = statistics.fmean(trial_runs) / statistics.fmean(base_runs)
    half = z * math.sqrt(vt + vb + extra_var)
    return Interval(r, r * math.exp(-half), r * math.exp(half))


# Launch-to-launch noise (issue 17 item 4).  The passes of one launch show only the noise inside
# it; a re-launch of the same server moves its throughput again (memory layout, clocks, the
# host's other load), and a speedup divides two launches.  The study re-launches anyway: every
# host measures the baseline server more than once (search, confirmation), and the confirmation
# re-measures its candidates on a fresh launch, usually on another host.  Their spread beyond
# what the passes explain is that noise.  Until there is some, a prior of this sd per speedup
# (what the simulated engine and the reference hosts show: 1-2%) holds the place, weighted as
# this many re-launch pairs; even launches that agree perfectly leave a floor, as a handful of
# pairs cannot prove less.  The three are the study's policy (optimizer.policy: prior_launch_sd,
# prior_pairs, min_launch_sd), handed to `launch_noise`.


@dataclass(frozen=True)
class Relaunch:
    """One launch's measurement of something measured on other launches too.

    `group` names what was measured (e.g. host and level of a baseline, or configuration and
    level of a speedup); `weight` is how many launches of it one speedup holds (2 for a baseline's
    tok/s: a speedup divides a trial launch by a baseline launch; 1 for a speedup itself).
    """

    group: str
    value: float
    within_var: float  # variance of log(value) from the launch's own passes
    weight: float = 1.0


@dataclass(frozen=True)
class LaunchNoise:
    """The variance of a speedup's log beyond its passes' spread, and what it was estimated from."""

    variance: float
    groups: int  # measurements re-launched at least once
    pairs: float  # degrees of freedom from the data (the prior adds the policy's prior_pairs)

    @property
    def sd(self) -> float:
        return math.sqrt(self.variance)

    def as_json(self) -> dict[str, float]:
        return {"sd": self.sd, "relaunched": self.groups, "degrees_of_freedom": self.pairs}


def launch_noise(relaunches: Sequence[Relaunch], policy: Policy = DEFAULT_POLICY) -> LaunchNoise:
    """Pooled launch-to-launch variance of a speedup's log (method of moments, with the prior
    and the floor of the study's `policy`).

    Per group of n launches: Σ(x_i - x̄)² has expectation (n-1)·σ² + (n-1)/n·Σ w_i, where x is
    the log of each launch's value and w its passes' variance; what exceeds the passes is σ².
    """
    groups: dict[str, list[Relaunch]] = {}
    for r in relaunches:
        if r.value > 0:
            groups.setdefault(r.group, []).append(r)
    excess = policy.prior_pairs * policy.prior_launch_sd**2
    dof = 0.0
    used = 0
    for members in groups.values():
        n = len(members)
        if n < 2:
            continue
        xs = [math.log(m.value) for m in members]
        mean = statistics.fmean(xs)
        ss = sum((x - mean) ** 2 for x in xs)
        within = (n - 1) / n * sum(m.within_var for m in members)
        weight = statistics.fmean(m.weight for m in members)
        excess += weight * (ss - within)
        dof += n - 1
        used += 1
    variance = max(excess / (dof + policy.prior_pairs), policy.min_launch_sd**2)
    return LaunchNoise(variance, used, dof)


def level_intervals(
    levels: Sequence[Mapping[str, Any]], baseline_levels: Sequence[Mapping[str, Any]], extra_var: float = 0.0
) -> dict[int, Interval]:
    """The 95% interval of each level's speedup.

    A level either side marked saturated (the load generator or the host could not keep up,
    workers/loadgen/saturation.py) gets none: its spread is the host's, not the configuration's.
    `extra_var` widens each by the launch-to-launch noise (`launch_noise`).
    """
    base = {int(b["concurrency"]): b for b in baseline_levels}
    out: dict[int, Interval] = {}
    for lv in levels:
        c = int(lv["concurrency"])
        if c in base and not (lv.get("saturated") or base[c].get("saturated")):
            iv = ratio_interval(
                lv.get("output_tok_s_runs") or [], base[c].get("output_tok_s_runs") or [], extra_var=extra_var
            )
            if iv is not None:
                out[c] = iv
    return out


# In this module (no Optuna): the worker's extra confirmation passes (workers/resolve.py) ask it,
# and a GPU host's worker-only install has no Optuna.
def undecided(
    *,
    levels: Sequence[int],
    objective_concurrency: int | None,
    trial_runs: Mapping[int, Sequence[float]],
    baseline_runs: Mapping[int, Sequence[float]],
    thresholds: Sequence[float],
    extra_var: float,
) -> tuple[float | None, bool]:
    """(a decision threshold the objective's 95% interval still holds, could more passes clear it).

    The interval of the candidate's passes against the paired baseline's, widened by the launch
    noise; (None, False) once it clears every threshold.  "Could": with the candidate's own
    spread taken to 0 (infinitely many passes), would the interval clear it?  If not, the rest is
    the baseline's passes and the launch noise, which more passes here cannot shrink.
    """
    wanted = [objective_concurrency] if objective_concurrency is not None else list(levels)
    logs, within, floor = [], [], []
    for c in wanted:
        t, b = trial_runs.get(c) or [], baseline_runs.get(c) or []
        vt, vb = log_mean_variance(t), log_mean_variance(b)
        if vt is None or vb is None:
            return None, False  # no spread to judge: nothing more passes can settle here
        logs.append(math.log(statistics.fmean(t) / statistics.fmean(b)))
        within.append(vt + vb + extra_var)
        floor.append(vb + extra_var)
    n = len(wanted)
    centre = math.exp(sum(logs) / n)
    correlated = extra_var * (1.0 - 1.0 / n)

    def half(vs: list[float]) -> float:
        return Z95 * math.sqrt(sum(vs) / n**2 + correlated)

    h, h_floor = half(within), half(floor)
    for th in thresholds:
        if centre * math.exp(-h) <= th <= centre * math.exp(h):
            return th, not (centre * math.exp(-h_floor) <= th <= centre * math.exp(h_floor))
    return None, False
