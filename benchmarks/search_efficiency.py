"""Launches and GPU-hours until a study declares its answer, per strategy.  (Run by hand.)

    python benchmarks/search_efficiency.py --strategies default          # 9 cases x 20 seeds
    python benchmarks/search_efficiency.py --seeds 5                     # a smoke run, all strategies
    python benchmarks/search_efficiency.py --workers 4 --cases moe-pcie@1,dense-8b-h100@1
    python benchmarks/search_efficiency.py --strategies default --workers 2,4   # fleets side by side

No servers: every launch is simulated with the simulator's pure model (`spectune_sim.model`):
start-up seconds and memory check of the server launched, throughput and accept length per
concurrency level from `predict`, with the simulator's noise model (per-request lognormal timing
noise averaged over the workload, scaled by the landscape's `noise_scale`; acceptance sampling
noise; a per-host offset that cancels against the same host's baseline; a per-host offset of
the speedup that does not, `--spec-host-sd`; a slow drift over simulated wall time; each start at
its own speed where the landscape has launch noise, `Landscape.launch_sigma`: the drawn engines
of `benchmarks/family.py`, none of the cases here).

Strategies, each on every case (a landscape at a workload; two levels make the objective their
geometric mean) and seed:

* `default` - the study the service runs: `optimizer.conductor`, the object the API asks, decides
  every step (baselines, asks, the stop rule, the move to confirmation, the pairing of each
  confirmation with a fresh baseline, each confirmation's deployment envelope and extra passes,
  the finish); the service's own code carries its actions out (optimizer/actions.py) on the
  in-memory store (optimizer/memory_store.py: Optuna's InMemoryStorage, the leases, the baselines),
  and optimizer/rehearsal.py (shared with `spectune study plan`) runs simulated hosts on one clock, `--workers` of them asking in the order of their clocks, so proposals are made while
  other hosts' launches are in flight.  Duplicates are answered as the service answers them, and
  the answer is the service's (the cheapest confirmed candidate tied with the best within
  `min_gain`, optimizer.answer.winner).  tests/benchmarks/test_search_efficiency.py checks that the
  service, through its REST API, runs the same launches and finishes with the same reason.
* `budget20` - the same study with the convergence stop off and `max_trials: 20`.
* `tpe` - Optuna's default TPESampler() over the raw space (steps 1-10, topk {1,2,4,8}, draft
  tokens 2-64 as independent integers), 20 launches on one host; no domain knowledge: every
  proposal is launched (a tree SGLang cannot fill fails after its start-up), failures told as 0,
  SGLang's default graph capture up to the largest level; its answer is the best measured.
* `grid` - SGLang's `bench_speculative.py` grid (optimizer.costs.grid_points), each point a
  fresh server; its answer is the best measured.

Everything is counted: baselines (re-measured every 6 h of simulated time, and the fresh ones
of the confirmation), search launches, confirmations, failed launches.  GPU-hours = (start-up +
warm-up + benchmark) x the landscape's GPUs.  The answer's share = its true objective / the true
optimum, where "run without speculation" counts as 1.0x and the optimum is at least 1.0x.  The
calibration table counts, over every case and seed, the studies whose answer (and whose
incumbent when the search stopped) is more than `min_gain` below the optimum, and those that ran
to the `max_trials` cap, with the stop rule that ended each (optimizer.stop_rules.StopRule).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import optuna

from optimizer import answer as answer_
from optimizer import attrs as A
from optimizer import conductor, costs, rehearsal
from optimizer import study as opt
from optimizer.memory_store import MemoryStudy
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.rehearsal import Host, Plan, Workload, clock_at, spectune_plan
from optimizer.space import SearchSpace, SpecConfig, max_draft_tokens
from optimizer.spec import StudySpec
from optimizer.study_state import FinishReason
from spectune_sim.landscapes import LANDSCAPES, Landscape
from spectune_sim.model import (
    InfeasibleConfigError,
    NoiseModel,
    check_memory,
    predict,
)
from workers.resolve import resolve

WITHIN = 0.98


def drive(hosts: list[Host], spec: StudySpec, policy: Policy = DEFAULT_POLICY) -> MemoryStudy:
    """One study as the service runs it (optimizer.rehearsal.drive), the worker answering each
    confirmation's Resolve order as workers/resolve.py does."""
    return rehearsal.drive(hosts, spec, resolve, policy)


class Truth:
    """The noise-free objective (geomean of speedups over the levels) of every configuration."""

    def __init__(self, landscape: Landscape, workload: Workload, plan: Plan, space: SearchSpace) -> None:
        self.ls, self.wl, self.plan = landscape, workload, plan
        self._cache: dict[str, float] = {}
        best = max((self.value(c), c.key) for c in space.iter_configs())
        self.optimum, self.optimum_key = best

    def value(self, config: SpecConfig) -> float:
        c = config.canonical()
        if c.key in self._cache:
            return self._cache[c.key]
        p = self.plan
        v = 0.0
        # The plan exactly as every host launches it (optimizer.rehearsal.Host._measure): the baseline
        # too runs with the study's graph settings, or at a level above the engine's default
        # capture size the truth would divide by an eager baseline no host measured.
        mrr, bs, max_bs = p.max_running_requests, p.cuda_graph_bs, p.cuda_graph_max_bs
        mem = check_memory(self.ls, c, max_running_requests=mrr, cuda_graph_bs=bs, cuda_graph_max_bs=max_bs)
        if mem.ok and c.num_draft_tokens <= max_draft_tokens(c.num_steps, c.topk):
            logs = []
            for lvl in self.wl.levels:
                base = predict(
                    self.ls, None, lvl, max_running_requests=mrr, cuda_graph_bs=bs, cuda_graph_max_bs=max_bs
                ).output_tok_s
                try:
                    tok = predict(
                        self.ls, c, lvl, max_running_requests=mrr, cuda_graph_bs=bs, cuda_graph_max_bs=max_bs
                    ).output_tok_s
                except InfeasibleConfigError:
                    tok = 0.0
                logs.append(math.log(max(tok, 1e-9) / base))
            v = math.exp(statistics.fmean(logs))
        self._cache[c.key] = v
        return v


@dataclass
class Run:
    """One strategy on one landscape and seed: every launch in order."""

    truths: list[float] = field(default_factory=list)  # true objective of each launched config
    measured: list[float] = field(default_factory=list)  # what the strategy saw (0 on failure)
    gpu_s: list[float] = field(default_factory=list)  # cumulative GPU-seconds after each launch

    def add(self, truth: float, measured: float, gpu_s: float) -> None:
        self.truths.append(truth)
        self.measured.append(measured)
        self.gpu_s.append(gpu_s)

    def to_within(self, optimum: float) -> tuple[int | None, float | None]:
        for i, t in enumerate(self.truths):
            if t >= WITHIN * optimum:
                return i + 1, self.gpu_s[i]
        return None, None

    def reported(self, budget: int) -> float:
        """True objective of the best *measured* configuration among the first `budget` launches."""
        n = min(budget, len(self.measured))
        if n == 0:
            return 0.0
        i = max(range(n), key=lambda j: self.measured[j])
        return self.truths[i]


def spec_for(workload: Workload, sampler: str, seed: int) -> StudySpec:
    return StudySpec.model_validate(
        {
            "name": "bench",
            "model": {"target": "t", "draft": "d"},
            "workload": {
                "concurrency": list(workload.levels),
                "num_prompts": workload.num_prompts,
                "output_len": workload.output_len,
                "repeats": workload.repeats,
            },
            "sampler": sampler,
            "seed": seed,
        }
    )


@dataclass
class Answer:
    """One run to its declared answer: every launch counted, and how good the answer is."""

    launches: int
    by_kind: dict[str, int]
    gpu_h: float
    gpu_h_by_kind: dict[str, float]
    share: float  # true objective of the answer / true optimum (the baseline counts as 1.0)
    oom: int
    reason: str
    # True objective of the incumbent the stop rule stopped on (the best measured in the search) /
    # the optimum: what the stop rule is answerable for, before confirmation chooses among ties.
    incumbent_share: float | None = None
    rule: str | None = None  # the stop rule that ended the search (optimizer.stop_rules.StopRule)
    wall_h: float | None = None  # hours from the study's start until it finished (the service's studies)
    # The answer runs a speculative configuration (False: the baseline, "speculation does not pay"):
    # a host's speculative offset moves the former's speed and not the latter's (benchmarks/family.py).
    speculative: bool = True


def _answer(
    hosts: Sequence[Host],
    truth: Truth,
    value: float,
    reason: str,
    incumbent: float | None = None,
    rule: str | None = None,
) -> Answer:
    by_kind: dict[str, int] = {}
    gpu: dict[str, float] = {}
    for h in hosts:
        for k, v in h.launches.items():
            by_kind[k] = by_kind.get(k, 0) + v
        for k, g in h.gpu_by_kind.items():
            gpu[k] = gpu.get(k, 0.0) + g / 3600
    oom = by_kind.pop("oom", 0)
    best = max(truth.optimum, 1.0)
    return Answer(
        sum(by_kind.values()),
        by_kind,
        sum(gpu.values()),
        gpu,
        value / best,
        oom,
        reason,
        None if incumbent is None else incumbent / best,
        rule,
    )


def run_study(hosts: list[Host], truth: Truth, spec: StudySpec, policy: Policy = DEFAULT_POLICY) -> Answer:
    """One study as the service runs it (`drive`), and its answer as the service gives it."""
    return _study_answer(drive(hosts, spec, policy), hosts, truth)


def _study_answer(store: MemoryStudy, hosts: Sequence[Host], truth: Truth) -> Answer:
    """The study's answer as the service gives it (api.services.studies: the winner)."""
    spec = store.spec
    assert store.ending is not None
    reason = f"{store.ending.reason.value}: {store.ending.detail}"
    snap = store.snapshot(clock_at(max(h.clock_s for h in hosts)), [h.host_id for h in hosts])
    best = opt.best_trial_of(snap.trials)
    incumbent = 1.0 if best is None else truth.value(A.TrialRecord(best).config)
    if best is None or float(best.value or 0.0) <= 1.0:
        incumbent = 1.0  # the baseline is the incumbent
    assessment = conductor.stop_rule(spec, snap.trials, snap.policy, snap.verify_shapes())
    rule = None if assessment is None or assessment.rule is None else assessment.rule.value

    wall_h = (max(h.clock_s for h in hosts) - store.created_at.timestamp()) / 3600

    def answer(value: float, speculative: bool) -> Answer:
        got = _answer(hosts, truth, value, reason, incumbent, rule)
        return dataclasses.replace(got, wall_h=wall_h, speculative=speculative)

    if store.ending.reason == FinishReason.DOES_NOT_PAY:
        return answer(1.0, False)  # "speculation does not pay": run the baseline
    # The service's winner (optimizer.answer.winner), as the conductor re-launches it.
    choice = conductor.winner(snap)
    if choice is not None and choice.winner.violation <= 0:
        top = choice.winner
        pays = printed_pays(top)
        return answer(truth.value(top.config) if pays else 1.0, pays)
    return answer(incumbent, best is not None and float(best.value or 0.0) > 1.0)


def printed_pays(winner: answer_.Contender) -> bool:
    """Does the service print the winner's speculative command?  Only where its interval clears
    1.0 (optimizer.answer.pays, which api.services.studies plans the deployment by); a winner
    whose interval straddles 1.0 is printed as "does not pay here; run without speculation", and
    the user runs the baseline, so that is what the answer is judged as."""
    return answer_.clears(winner.speedup, winner.interval)


def _measured_value(host: Host, config: SpecConfig) -> tuple[str, float]:
    base = host.baseline_levels()
    outcome, levels = host.launch(config)
    if outcome != "ok":
        return outcome, 0.0
    b = {x["concurrency"]: x["output_tok_s"] for x in base}
    logs = [math.log(lv["output_tok_s"] / b[lv["concurrency"]]) for lv in levels]
    return outcome, math.exp(statistics.fmean(logs))


def run_tpe(host: Host, truth: Truth, seed: int, max_launches: int) -> Run:
    run = Run()
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    for _ in range(max_launches):
        trial = study.ask()
        steps = trial.suggest_int("num_steps", 1, 10)
        topk = trial.suggest_categorical("topk", [1, 2, 4, 8])
        ndt = trial.suggest_int("num_draft_tokens", 2, 64)
        config = SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=ndt)
        _, value = _measured_value(host, config)
        study.tell(trial, value)
        real = config.canonical()
        valid = real.num_draft_tokens <= max_draft_tokens(real.num_steps, real.topk)
        run.add(truth.value(real) if valid and value > 0 else 0.0, value, host.gpu_s)
    return run


def run_grid(host: Host, truth: Truth) -> Run:
    run = Run()
    for config in costs.grid_points():
        outcome, value = _measured_value(host, config)
        run.add(truth.value(config) if outcome == "ok" else 0.0, value, host.gpu_s)
    return run


STUDY_STRATEGIES = ("default", "budget20", "tpe", "grid")


@dataclass(frozen=True)
class Case:
    """A landscape measured at a workload: `levels` > 1 makes the objective their geometric mean."""

    landscape: str
    levels: tuple[int, ...]
    misfit: str = ""  # what the `auto` sampler's model cannot represent here, if anything

    @property
    def label(self) -> str:
        return f"{self.landscape}@{'+'.join(map(str, self.levels))}"


# The memory-bound landscapes are measured where memory binds: spectune captures graphs only for
# the workload's levels, so at level 1 nothing runs out of memory there.
CASES: tuple[Case, ...] = (
    Case("moe-pcie", (1,)),
    Case("dense-8b-h100", (1,)),
    Case("dense-8b-h100", (1, 16)),
    Case("no-gain", (1,)),
    Case("mem-tight", (64,)),
    Case("draft-mem-cliff", (16,)),
    Case("zigzag-tiles", (1,), "acceptance not monotone in the draft position; verify cost steps at 16-token tiles"),
    Case("two-peaks", (1,), "a hard token at draft position 3: a second local optimum 2% below the best"),
    Case("noisy-8b", (1,), "three times the calibrated timing noise"),
)
# Per-host speedup offset that the host's own baseline does not cancel (NoiseModel.spec_host_sigma):
# an assumption (half a percent), so several hosts are not interchangeable.
SPEC_HOST_SD = 0.005


def _run_answer(hosts: Sequence[Host], truth: Truth, run: Run) -> Answer:
    best = max(truth.optimum, 1.0)
    n = len(run.measured)
    share = run.reported(n) / best if n and max(run.measured) > 1.0 else 1.0 / best
    return _answer(hosts, truth, share * best, "fixed")


def simulate_seed(
    landscape: Landscape,
    workload: Workload,
    seed: int,
    *,
    workers: int = 2,
    strategies: Sequence[str] = STUDY_STRATEGIES,
    spec_host_sd: float = SPEC_HOST_SD,
    policy: Policy = DEFAULT_POLICY,
) -> dict[str, Answer]:
    """Every strategy on one landscape and seed (each seed's hosts and noise are its own, so seeds
    can run in any order or process and give the same answers)."""
    space = SearchSpace()
    out: dict[str, Answer] = {}
    top = max(workload.levels)
    default_plan = Plan(max_running_requests=top, cuda_graph_max_bs=top)
    noise = NoiseModel(spec_host_sigma=spec_host_sd)
    spec = spec_for(workload, "auto", seed)
    plan = spectune_plan(spec)
    truth = Truth(landscape, workload, plan, space)
    for name in strategies:

        def hosts_of(p: Plan, n: int, name: str = name) -> list[Host]:
            return [
                Host(
                    landscape,
                    workload,
                    p,
                    random.Random(f"{landscape.name}/{seed}/{name}/{k}"),
                    seed,
                    noise=noise,
                    host_id=f"h{k}",
                )
                for k in range(n)
            ]

        if name in ("default", "budget20"):
            hs = hosts_of(plan, workers)
            s = (
                spec
                if name == "default"
                else spec.model_copy(
                    update={"budget": spec.budget.model_copy(update={"converge": False, "max_trials": 20})}
                )
            )
            out[name] = run_study(hs, truth, s, policy)
        elif name == "tpe":
            hs = hosts_of(default_plan, 1)
            run = run_tpe(hs[0], truth, seed, 20)
            out[name] = _run_answer(hs, truth, run)
        else:
            hs = hosts_of(default_plan, 1)
            run = run_grid(hs[0], truth)
            out[name] = _run_answer(hs, truth, run)
    return out


def simulate_studies(
    landscape: Landscape,
    workload: Workload,
    seeds: int,
    *,
    workers: int = 2,
    strategies: Sequence[str] = STUDY_STRATEGIES,
    spec_host_sd: float = SPEC_HOST_SD,
) -> dict[str, list[Answer]]:
    out: dict[str, list[Answer]] = {s: [] for s in strategies}
    for seed in range(seeds):
        got = simulate_seed(
            landscape, workload, seed, workers=workers, strategies=strategies, spec_host_sd=spec_host_sd
        )
        for name in strategies:
            out[name].append(got[name])
    return out


def _case_seed(job: tuple[Case, int, int, tuple[str, ...], float, Policy]) -> dict[str, Answer]:
    case, seed, workers, strategies, spec_host_sd, policy = job
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return simulate_seed(
        LANDSCAPES[case.landscape],
        Workload(levels=case.levels),
        seed,
        workers=workers,
        strategies=strategies,
        spec_host_sd=spec_host_sd,
        policy=policy,
    )


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def below_min_gain(share: float | None, min_gain: float = 0.01) -> bool:
    """More than `min_gain` below the optimum (what the stop rule says it risks at most 10% of the time)."""
    return share is not None and share * (1.0 + min_gain) < 1.0


def study_report(
    name: str, levels: Sequence[int], cells: dict[str, list[Answer]], seeds: int, workers: int = 2
) -> list[str]:
    lines = [
        f"### {name} (levels {list(levels)}, {seeds} seeds, {workers} workers)",
        "",
        "| strategy | median launches to the answer | baselines / search / confirm / failed | median GPU-h | "
        "answer within 2% | median share of optimum | OOM launches (median / max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s, answers in cells.items():
        split = " / ".join(
            f"{_median([a.by_kind.get(k, 0) for a in answers]):g}" for k in ("baseline", "search", "confirm", "failed")
        )
        within = sum(1 for a in answers if a.share >= WITHIN)
        ooms = [a.oom for a in answers]
        lines.append(
            f"| {s} | {_median([a.launches for a in answers]):g} | {split} | {_median([a.gpu_h for a in answers]):.2f} | "
            f"{within}/{len(answers)} | {100 * _median([a.share for a in answers]):.1f}% | "
            f"{_median(ooms):g} / {max(ooms)} |"
        )
    d = cells.get("default")
    if d:
        lines.append("")
        lines.append("default study ended by: " + ", ".join(f"{k} ({v})" for k, v in sorted(_endings(d).items())))
        lines.append(
            f"default study: answer more than 1% below the optimum in {sum(below_min_gain(a.share) for a in d)}/{len(d)}, "
            f"the incumbent it stopped on in {sum(below_min_gain(a.incumbent_share) for a in d)}/{len(d)}"
        )
    lines.append("")
    return lines


def per_seed_report(label: str, answers: Sequence[Answer], first_seed: int = 0) -> list[str]:
    """One line per seed of the default study: where a table's counts come from."""
    out = []
    for seed, a in enumerate(answers, start=first_seed):
        split = "/".join(str(a.by_kind.get(k, 0)) for k in ("baseline", "search", "confirm", "failed"))
        inc = "-" if a.incumbent_share is None else f"{a.incumbent_share:.4f}"
        wall = "" if a.wall_h is None else f", {a.wall_h:.3f} h"
        out.append(
            f"  {label} seed {seed}: {a.launches} launches ({split}){wall}, answer {a.share:.4f}, incumbent {inc}; "
            f"{a.reason[:160]}"
        )
    return [*out, ""]


def _endings(answers: Sequence[Answer]) -> dict[str, int]:
    """Finish reasons, by the conductor's reason and the stop rule that settled the search."""
    out: dict[str, int] = {}
    for a in answers:
        key = a.reason.split(":")[0] + (f" ({a.rule} rule)" if a.rule else "")
        out[key] = out.get(key, 0) + 1
    return out


def calibration_report(results: Sequence[tuple[Case, list[Answer]]], workers: int) -> list[str]:
    """The stop rule's calibration over every case and seed of the default study."""
    rows = [
        "### Calibration of the stop rule (default study, every case and seed)",
        "",
        "| case | studies | median launches | median wall-h | answer within 2% | answer > 1% below optimum | "
        "incumbent > 1% below optimum | ran to the cap | stopped by |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    total = below = below_inc = capped = 0
    for case, answers in results:
        n = len(answers)
        b = sum(below_min_gain(a.share) for a in answers)
        bi = sum(below_min_gain(a.incumbent_share) for a in answers)
        cap = sum(1 for a in answers if a.reason.startswith(FinishReason.MAX_TRIALS.value))
        total, below, below_inc, capped = total + n, below + b, below_inc + bi, capped + cap
        rules = ", ".join(f"{k} {v}" for k, v in sorted(_endings(answers).items()))
        rows.append(
            f"| {case.label} | {n} | {_median([a.launches for a in answers]):g} | "
            f"{_median([a.wall_h or 0.0 for a in answers]):.2f} | "
            f"{sum(a.share >= WITHIN for a in answers)}/{n} | {b}/{n} | {bi}/{n} | {cap}/{n} | {rules} |"
        )
    if total:
        rows.append(
            f"| **all** ({workers} workers) | {total} | | | | **{100 * below / total:.1f}%** | "
            f"**{100 * below_inc / total:.1f}%** | **{100 * capped / total:.1f}%** | |"
        )
    rows.append("")
    return rows


# The fleet table's bootstrap: resamples of each fleet's seeds (a fixed seed: the same table each run).
BOOTSTRAP_RESAMPLES = 2000


def _median_diff_interval(a: Sequence[float], b: Sequence[float], level: float = 0.90) -> tuple[float, float]:
    """The `level` percentile interval of median(b) - median(a) over bootstrap resamples of each
    (independent samples: a seed's hosts and noise differ with the fleet's size)."""
    rng = random.Random(0)
    diffs = sorted(
        statistics.median(rng.choices(b, k=len(b))) - statistics.median(rng.choices(a, k=len(a)))
        for _ in range(BOOTSTRAP_RESAMPLES)
    )
    tail = (1.0 - level) / 2
    return diffs[int(tail * len(diffs))], diffs[int((1.0 - tail) * len(diffs)) - 1]


def fleet_report(by_workers: dict[int, list[tuple[Case, list[Answer]]]]) -> list[str]:
    """The default study with each larger fleet against the smallest, per case: median launches
    against the smallest fleet's median plus one baseline per extra host (issue 16's bar), and the
    median wall time from the study's start to its answer (the mean beside it); each difference
    with its bootstrap interval."""
    counts = sorted(by_workers)
    small = counts[0]
    rows = [
        f"### Fleets against {small} workers (default study; 90% bootstrap intervals of the differences)",
        "",
        "| case | workers | median launches | allowed | launches met | launches +, interval | "
        "median wall-h | mean wall-h | wall shorter | median wall-h -, interval |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = dict((c.label, answers) for c, answers in by_workers[small])
    for w in counts[1:]:
        for case, answers in by_workers[w]:
            ref = base.get(case.label)
            if not ref:
                continue
            la, lb = [float(a.launches) for a in ref], [float(a.launches) for a in answers]
            wa, wb = [a.wall_h or 0.0 for a in ref], [a.wall_h or 0.0 for a in answers]
            allowed = _median(la) + (w - small)  # one baseline per extra host
            lo, hi = _median_diff_interval(la, lb)
            wlo, whi = _median_diff_interval(wb, wa)
            shorter = _median(wb) < _median(wa)
            rows.append(
                f"| {case.label} | {small} / {w} | {_median(la):g} / {_median(lb):g} | {allowed:g} | "
                f"{'yes' if _median(lb) <= allowed else 'no'} | {_median(lb) - _median(la):+g} [{lo:+g}, {hi:+g}] | "
                f"{_median(wa):.3f} / {_median(wb):.3f} | {statistics.fmean(wa):.3f} / {statistics.fmean(wb):.3f} | "
                f"{'yes' if shorter else 'no'} | {_median(wa) - _median(wb):+.3f} [{wlo:+.3f}, {whi:+.3f}] |"
            )
    rows.append("")
    return rows


def _worker_counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise ValueError(text)
    return counts


def add_policy_flag(ap: argparse.ArgumentParser) -> None:
    """`--policy KEY=VALUE` (repeatable): a field of optimizer.policy.Policy; `policy_of` reads it."""
    ap.add_argument(
        "--policy", action="append", default=[], metavar="KEY=VALUE", help="a field of optimizer.policy.Policy"
    )


def policy_of(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Policy:
    """The policy `--policy` asks for, or the parser's usage error naming the field it refuses."""
    try:
        return DEFAULT_POLICY.with_overrides(args.policy)
    except ValueError as e:
        ap.error(str(e))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument(
        "--first-seed", type=int, default=0, help="seeds first..first+seeds-1 (another sample than the one tuned on)"
    )
    ap.add_argument("--cases", default=",".join(c.label for c in CASES), help="case labels, comma-separated")
    ap.add_argument(
        "--workers",
        default="2",
        help="workers (hosts) of the service's studies; several, comma-separated (2,4): each fleet, then "
        "the larger fleets against the smallest",
    )
    ap.add_argument("--strategies", default=",".join(STUDY_STRATEGIES))
    ap.add_argument("--spec-host-sd", type=float, default=SPEC_HOST_SD)
    ap.add_argument("--jobs", type=int, default=1, help="processes running (case, seed) pairs side by side")
    ap.add_argument("--per-seed", action="store_true", help="one line per default study: launches, shares, reason")
    add_policy_flag(ap)
    args = ap.parse_args(argv)
    policy = policy_of(ap, args)
    by_label = {c.label: c for c in CASES}
    strategies = [s for s in args.strategies.split(",") if s]
    try:
        fleets = _worker_counts(args.workers)
    except ValueError:
        ap.error(f"--workers {args.workers!r}: give distinct worker counts of at least 1, comma-separated (2 or 2,4)")
    t0 = time.monotonic()
    print(
        f"search efficiency: {args.seeds} seeds from {args.first_seed}, "
        f"{', '.join(map(str, fleets))} workers for the studies, "
        f"per-host offset sd {args.spec_host_sd}, policy {policy.changed() or 'default'}",
        flush=True,
    )
    cases = []
    for label in args.cases.split(","):
        if label not in by_label:
            ap.error(f"no case {label!r}; known: {', '.join(by_label)}")
        cases.append(by_label[label])
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    if args.first_seed < 0 or args.seeds < 1:
        ap.error("--first-seed must be at least 0 and --seeds at least 1")
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [
        (case, seed, w, tuple(strategies), args.spec_host_sd, policy)
        for w in fleets
        for case in cases
        for seed in seeds
    ]
    if args.jobs > 1:
        # Each (case, seed) is independent and seeded by itself: the same answers in any process.
        with ProcessPoolExecutor(args.jobs) as pool:
            answers = list(pool.map(_case_seed, jobs))
    else:
        answers = [_case_seed(j) for j in jobs]
    by_workers: dict[int, list[tuple[Case, list[Answer]]]] = {}
    for f, w in enumerate(fleets):
        results = by_workers.setdefault(w, [])
        for k, case in enumerate(cases):
            at = (f * len(cases) + k) * args.seeds
            cells = {name: [a[name] for a in answers[at : at + args.seeds]] for name in strategies}
            print("\n".join(study_report(case.label, case.levels, cells, args.seeds, w)), flush=True)
            if args.per_seed and "default" in cells:
                print("\n".join(per_seed_report(case.label, cells["default"], args.first_seed)), flush=True)
            if "default" in cells:
                results.append((case, cells["default"]))
        print("\n".join(calibration_report(results, w)), flush=True)
    if len(fleets) > 1 and "default" in strategies:
        print("\n".join(fleet_report(by_workers)), flush=True)
    print(f"({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
