"""The service's study over a family of drawn engines (spectune_sim.family).  (Run by hand.)

    python -m benchmarks.family --engines 200 --jobs 2                 # engines 0-199 of family v1
    python -m benchmarks.family --engines 20 --subfamily seed-like     # the first 20 seed-like ones
    python -m benchmarks.family --engines 10 --per-engine              # one line per engine, as each ends
    python -m benchmarks.family --engines 200 --jobs 2 --deadline-s 1800   # a bounded run: the prefix done
    python -m benchmarks.family --cases all --seeds 20 --jobs 2        # the same figures, hand-written cases

Each engine k runs one study as the service runs it, through search_efficiency's driver
(`drive`: optimizer.conductor decides every step; every launch counted: baselines, search,
confirmations, failed starts), on `--workers` simulated hosts (2 by default) whose speculative
speed is offset by the engine's host offsets, each launch at its own speed (launch noise), at the
engine's levels (two levels: their geometric mean), with study seed k.  The answer's share is its
true objective over the true optimum in the tuning launch's graphs (search_efficiency.Truth).

Beside the answers it reads what the model said before each launch (the trial's
`model_prediction`: the predicted speedup and the sd of its log):

* the calibration of its 90% predictive interval: the share of launches with a result whose
  measured speedup fell inside speedup x exp(+-1.645 sd), with the sd the model stated alone and
  with the sd its prediction check states for a measurement (optimizer.stop_rules: the model's,
  the launch's measurement noise and the host offset it allows, HOST_SD);
* among the first four proposals of the model (moves other than "start"), how many it predicted
  to lose by more than 20% to the best measured so far (the baseline counts as 1.0x): predicted
  speedup < 0.8 x that best, by the results in when it was asked.  A loser proposed with a
  stated purpose (the trial's `proposal_purpose`, optimizer.model_sampler.LOSE_BY: resolving a
  part of the model) is counted apart, as "+N with a purpose".
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TypeVar

import optuna
from optuna.trial import FrozenTrial, TrialState

from benchmarks.search_efficiency import (
    CASES,
    SPEC_HOST_SD,
    WITHIN,
    Answer,
    Case,
    Truth,
    _study_answer,
    add_policy_flag,
    below_min_gain,
    drive,
    policy_of,
    spec_for,
)
from optimizer import attrs as A
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.rehearsal import Host, Workload, spectune_plan
from optimizer.space import SearchSpace
from optimizer.stop_rules import HOST_SD, measurement_sd
from optimizer.study_state import FinishReason
from spectune_sim import family as F
from spectune_sim.landscapes import LANDSCAPES, Landscape
from spectune_sim.model import NoiseModel

J = TypeVar("J")
Z90 = 1.6448536269514722  # the 95th percentile of the standard normal: a two-sided 90% interval
# A proposal the model itself expects to lose to the best measured by more than this share.
LOSE_BY = 0.20
FIRST_PROPOSALS = 4


@dataclass(frozen=True)
class Coverage:
    """Launches with a result and a prediction made before it ran, and how many fell inside."""

    launches: int = 0
    inside_model: int = 0  # inside the interval of the model's own sd
    inside_stated: int = 0  # inside the interval with the measurement and host sd added

    def __add__(self, other: Coverage) -> Coverage:
        return Coverage(
            self.launches + other.launches,
            self.inside_model + other.inside_model,
            self.inside_stated + other.inside_stated,
        )


@dataclass(frozen=True)
class EngineResult:
    seed: int  # the study's seed (a drawn engine's: its index)
    name: str  # the drawn engine's name, or the hand-written case's label
    group: str  # its subfamily, or the case's label
    levels: tuple[int, ...]
    optimum: float
    answer: Answer
    min_gain: float
    coverage: Coverage
    first_proposals: int  # how many the model proposed among the first four (< 4 when fewer)
    first_losers: int  # of those, predicted to lose by more than LOSE_BY
    loser_moves: tuple[str, ...] = field(default_factory=tuple)  # the moves of those losers
    purposeful_losers: int = 0  # losers proposed with a stated purpose (not among first_losers)
    # The study's hosts' speculative slow-down, their geometric mean (1 + offset each): every
    # speculative configuration runs this many times slower on the fleet that measured it than on
    # the offset-free landscape, the baseline does not (spectune_sim.family.HostOffsetNoise).
    fleet_factor: float = 1.0

    @property
    def within(self) -> bool:
        return self.answer.share >= WITHIN

    @property
    def short(self) -> bool:
        return below_min_gain(self.answer.share, self.min_gain)

    @property
    def fleet_share(self) -> float:
        """The answer's true objective over the true optimum, both on the study's own hosts.

        Family hosts are only ever slower with speculation (offsets 0-8%), so on a seed-like engine
        (a 2-6% gain) the offset-free optimum can be a speed no host of the fleet reaches, and
        "speculation does not pay" the right answer for the fleet that would deploy it.
        """
        best = max(self.optimum, 1.0)
        value = self.answer.share * best / self.fleet_factor if self.answer.speculative else 1.0
        return value / max(self.optimum / self.fleet_factor, 1.0)

    @property
    def fleet_within(self) -> bool:
        return self.fleet_share >= WITHIN

    @property
    def fleet_short(self) -> bool:
        return below_min_gain(self.fleet_share, self.min_gain)

    @property
    def capped(self) -> bool:
        return self.answer.reason.startswith(FinishReason.MAX_TRIALS.value)


def coverage_of(trials: Sequence[FrozenTrial]) -> Coverage:
    """The 90% intervals the model stated before each launch against what the launch measured."""
    n = inside_model = inside_stated = 0
    for t in trials:
        r = A.TrialRecord(t)
        pred = r.model_prediction
        if t.state != TrialState.COMPLETE or pred is None or r.has(A.DUPLICATE_OF) or not r.has(A.LEVELS):
            continue
        speedup, sd = pred.get("speedup"), pred.get("log_sd")
        if not isinstance(speedup, int | float) or not isinstance(sd, int | float) or speedup <= 0 or not t.value:
            continue
        miss = abs(math.log(float(t.value)) - math.log(float(speedup)))
        stated = math.sqrt(float(sd) ** 2 + measurement_sd(r) ** 2 + HOST_SD**2)
        n += 1
        inside_model += miss <= Z90 * float(sd)
        inside_stated += miss <= Z90 * stated
    return Coverage(n, inside_model, inside_stated)


def first_losers(trials: Sequence[FrozenTrial]) -> tuple[int, int, tuple[str, ...], int]:
    """(proposals among the first four, those predicted to lose by more than LOSE_BY without a
    stated purpose, their moves, those with one)."""
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.value and t.datetime_complete and t.value > 0]
    proposals = [
        t
        for t in sorted(trials, key=lambda t: t.number)
        if (p := A.TrialRecord(t).model_prediction) is not None and p.get("move") != "start"
    ][:FIRST_PROPOSALS]
    losers: list[str] = []
    purposeful = 0
    for t in proposals:
        pred = A.TrialRecord(t).model_prediction or {}
        speedup = pred.get("speedup")
        asked = t.datetime_start
        if not isinstance(speedup, int | float) or asked is None:
            continue
        before = [float(d.value or 0.0) for d in done if d.datetime_complete and d.datetime_complete <= asked]
        best = max([1.0, *before])
        if float(speedup) < (1.0 - LOSE_BY) * best:
            if A.TrialRecord(t).proposal_purpose is not None:
                purposeful += 1
            else:
                losers.append(str(pred.get("move")))
    return len(proposals), len(losers), tuple(losers), purposeful


def run_engine(index: int, workers: int = 2, policy: Policy = DEFAULT_POLICY) -> EngineResult:
    """Engine `index`'s study as the service runs it (study seed = index), with its host offsets."""
    e = F.engine(index)
    # The per-host offsets are the engine's, not the default lognormal ones.
    noise = e.noise(NoiseModel(spec_host_sigma=0.0))
    return _study_on(e.landscape, e.levels, index, noise, workers, e.name, e.subfamily, policy)


def run_case(case: Case, seed: int, workers: int = 2, policy: Policy = DEFAULT_POLICY) -> EngineResult:
    """A hand-written case's study, exactly as search_efficiency's `default` strategy runs it."""
    noise = NoiseModel(spec_host_sigma=SPEC_HOST_SD)
    return _study_on(LANDSCAPES[case.landscape], case.levels, seed, noise, workers, case.label, case.label, policy)


def _study_on(
    landscape: Landscape,
    levels: tuple[int, ...],
    seed: int,
    noise: NoiseModel,
    workers: int,
    name: str,
    group: str,
    policy: Policy = DEFAULT_POLICY,
) -> EngineResult:
    """One study as the service runs it, and what its model said along the way."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # The study sets its metric names through an API Optuna marks experimental: not news per study.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    workload = Workload(levels=levels)
    spec = spec_for(workload, "auto", seed)
    plan = spectune_plan(spec)
    truth = Truth(landscape, workload, plan, SearchSpace())
    # Host streams named as search_efficiency.simulate_seed names them: the same studies.
    hosts = [
        Host(landscape, workload, plan, random.Random(f"{landscape.name}/{seed}/default/{k}"), seed, noise, f"h{k}")
        for k in range(workers)
    ]
    store = drive(hosts, spec, policy)
    answer = _study_answer(store, hosts, truth)
    fleet = math.exp(statistics.fmean(math.log(noise.spec_host_factor(seed, h.host_id)) for h in hosts))
    trials = store.study().get_trials(deepcopy=False)
    proposed, lost, moves, purposeful = first_losers(trials)
    return EngineResult(
        seed,
        name,
        group,
        levels,
        truth.optimum,
        answer,
        spec.budget.min_gain,
        coverage_of(trials),
        proposed,
        lost,
        moves,
        purposeful,
        fleet,
    )


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _share(hits: int, n: int) -> str:
    return f"{hits}/{n} ({100 * hits / n:.0f}%)" if n else "-"


def summary(results: Sequence[EngineResult], workers: int, title: str = f"Family v{F.FAMILY_VERSION}") -> list[str]:
    """Medians and shares over the studies: all of them, then each subfamily (or case)."""
    groups: list[tuple[str, list[EngineResult]]] = [("all", list(results))]
    for sub in F.SUBFAMILIES:
        got = [r for r in results if r.group == sub]
        if got:
            groups.append((sub, got))
    for label in dict.fromkeys(r.group for r in results if r.group not in F.SUBFAMILIES):
        groups.append((label, [r for r in results if r.group == label]))
    rows = [
        f"### {title}, {len(results)} studies, {workers} workers",
        "",
        "| engines | n | median launches (baseline/search/confirm/failed) | answer within 2% | "
        "more than min_gain short | on the fleet: within 2% / more than min_gain short | to the cap | "
        "OOM launches median / max | 90% interval covers (model sd / stated sd) | "
        "first-four proposals predicted to lose >20% | median wall time (h) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rs in groups:
        split = "/".join(
            f"{_median([r.answer.by_kind.get(k, 0) for r in rs]):g}"
            for k in ("baseline", "search", "confirm", "failed")
        )
        cov = sum((r.coverage for r in rs), Coverage())
        ooms = [r.answer.oom for r in rs]
        proposals = sum(r.first_proposals for r in rs)
        losers = sum(r.first_losers for r in rs)
        purposeful = sum(r.purposeful_losers for r in rs)
        studies_with = sum(1 for r in rs if r.first_losers)
        rows.append(
            f"| {label} | {len(rs)} | {_median([r.answer.launches for r in rs]):g} ({split}) | "
            f"{_share(sum(r.within for r in rs), len(rs))} | {_share(sum(r.short for r in rs), len(rs))} | "
            f"{_share(sum(r.fleet_within for r in rs), len(rs))} / {_share(sum(r.fleet_short for r in rs), len(rs))} | "
            f"{_share(sum(r.capped for r in rs), len(rs))} | {_median(ooms):g} / {max(ooms)} | "
            f"{_share(cov.inside_model, cov.launches)} / {_share(cov.inside_stated, cov.launches)} | "
            f"{_share(losers, proposals)} of proposals; {studies_with}/{len(rs)} studies"
            f"{f' (+{purposeful} with a purpose)' if purposeful else ''} | "
            f"{_median([r.answer.wall_h for r in rs if r.answer.wall_h is not None]):.2f} |"
        )
    moves: dict[str, int] = {}
    for r in results:
        for m in r.loser_moves:
            moves[m] = moves.get(m, 0) + 1
    two = [r for r in results if len(r.levels) > 1]
    rows += [
        "",
        f"two-level objectives: answer within 2% in {_share(sum(r.within for r in two), len(two))} "
        f"(on the fleet: {_share(sum(r.fleet_within for r in two), len(two))})",
        "first-four losers by move: " + (", ".join(f"{k} {v}" for k, v in sorted(moves.items())) or "none"),
        "ended by: " + ", ".join(f"{k} ({v})" for k, v in sorted(_endings(results).items())),
        "",
    ]
    return rows


def _endings(results: Sequence[EngineResult]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        key = r.answer.reason.split(":")[0] + (f" ({r.answer.rule} rule)" if r.answer.rule else "")
        out[key] = out.get(key, 0) + 1
    return out


def per_engine(results: Sequence[EngineResult]) -> list[str]:
    out = []
    for r in results:
        a = r.answer
        split = "/".join(str(a.by_kind.get(k, 0)) for k in ("baseline", "search", "confirm", "failed"))
        c = r.coverage
        out.append(
            f"  {r.name} [{r.group}] seed {r.seed}, levels {'+'.join(map(str, r.levels))}: optimum "
            f"{r.optimum:.3f}x, {a.launches} launches ({split}), {a.oom} OOM, answer {a.share:.4f} "
            f"(on the fleet {r.fleet_share:.4f} of {max(r.optimum / r.fleet_factor, 1.0):.3f}x), "
            f"covered {c.inside_model}/{c.inside_stated} of {c.launches}, first-four losers "
            f"{r.first_losers}/{r.first_proposals}"
            f"{f' (+{r.purposeful_losers} with a purpose)' if r.purposeful_losers else ''}; {a.reason[:120]}"
        )
    return [*out, ""]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--engines", type=int, default=200, help="how many engines (of --subfamily, when given)")
    ap.add_argument("--first", type=int, default=0, help="the first family index looked at")
    ap.add_argument("--subfamily", choices=F.SUBFAMILIES, help="only engines of this subfamily")
    ap.add_argument("--workers", type=int, default=2, help="simulated hosts of each study")
    ap.add_argument("--jobs", type=int, default=1, help="processes running engines side by side")
    ap.add_argument("--per-engine", action="store_true", help="one line per engine (or case and seed)")
    ap.add_argument(
        "--cases",
        help="instead of the family: search_efficiency's hand-written cases (labels, comma-separated, or 'all')",
    )
    ap.add_argument("--seeds", type=int, default=20, help="with --cases: seeds 0..N-1 of each case")
    ap.add_argument(
        "--deadline-s", type=float, help="summarise the engines finished (in index order) after this many seconds"
    )
    add_policy_flag(ap)
    args = ap.parse_args(argv)
    policy = policy_of(ap, args)
    if args.engines < 1 or args.first < 0:
        ap.error("--engines must be at least 1 and --first at least 0")
    if not 1 <= args.workers <= F.HOSTS:
        ap.error(f"--workers must be 1-{F.HOSTS} (the hosts whose offsets an engine draws)")
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    if args.deadline_s is not None and args.deadline_s <= 0:
        ap.error("--deadline-s must be positive")
    t0 = time.monotonic()
    if args.cases:
        return _main_cases(ap, args.cases, args.seeds, args.workers, args.jobs, args.per_engine, t0, policy)
    ks = F.indices(args.engines, args.subfamily, args.first)
    print(
        f"family v{F.FAMILY_VERSION}: {len(ks)} engines, indices {ks[0]}..{ks[-1]}"
        f"{'' if args.subfamily is None else ' (' + args.subfamily + ')'}, study seed = index, "
        f"{args.workers} workers, policy {policy.changed() or 'default'}",
        flush=True,
    )
    deadline = None if args.deadline_s is None else t0 + args.deadline_s
    results = _collect(_run, [(k, args.workers, policy) for k in ks], args.jobs, deadline, args.per_engine)
    if len(results) < len(ks):
        print(
            f"stopped at the deadline: the first {len(results)} of {len(ks)} engines "
            f"(indices {ks[0]}..{ks[len(results) - 1] if results else ks[0]}) are summarised",
            flush=True,
        )
    if results:
        print("\n".join(summary(results, args.workers)), flush=True)
    print(f"({time.monotonic() - t0:.0f} s)")
    return 0


def _collect(
    fn: Callable[[J], EngineResult], jobs: Sequence[J], procs: int, deadline: float | None, lines: bool
) -> list[EngineResult]:
    """`fn` over `jobs` in `procs` processes, in order, each line printed as its result comes;
    at `deadline` (monotonic seconds) the first results in order are kept and the rest cancelled,
    so a bounded run summarises a prefix of the family (engines 0..n-1)."""
    out: list[EngineResult] = []
    with ProcessPoolExecutor(procs) as pool:
        futures = [pool.submit(fn, j) for j in jobs]
        for f in futures:
            try:
                r = f.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                break
            out.append(r)
            if lines:
                print(per_engine([r])[0], flush=True)
        pool.shutdown(wait=True, cancel_futures=True)
    return out


def _run(job: tuple[int, int, Policy]) -> EngineResult:
    return run_engine(*job)


def _run_case(job: tuple[Case, int, int, Policy]) -> EngineResult:
    return run_case(*job)


def _main_cases(
    ap: argparse.ArgumentParser,
    labels: str,
    seeds: int,
    workers: int,
    jobs: int,
    lines: bool,
    t0: float,
    policy: Policy = DEFAULT_POLICY,
) -> int:
    """The same figures on the hand-written cases (the studies of search_efficiency's `default`)."""
    by_label = {c.label: c for c in CASES}
    wanted = list(by_label) if labels == "all" else [x for x in labels.split(",") if x]
    unknown = [x for x in wanted if x not in by_label]
    if unknown:
        ap.error(f"no case {', '.join(unknown)}; known: {', '.join(by_label)}")
    if seeds < 1:
        ap.error("--seeds must be at least 1")
    print(
        f"hand-written cases: {', '.join(wanted)}; seeds 0..{seeds - 1}, {workers} workers, "
        f"policy {policy.changed() or 'default'}",
        flush=True,
    )
    todo = [(by_label[x], seed, workers, policy) for x in wanted for seed in range(seeds)]
    results = _collect(_run_case, todo, jobs, None, lines)
    print("\n".join(summary(results, workers, "Hand-written cases")), flush=True)
    print(f"({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
