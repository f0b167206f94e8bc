"""How many restarts does each search strategy need to find the best configuration?  (Run by hand.)

    python benchmarks/search_efficiency.py                    # every landscape, 20 seeds (minutes)
    python benchmarks/search_efficiency.py --seeds 5 --quick  # a smoke run
    python benchmarks/search_efficiency.py --levels 1,64      # a two-level workload (geomean)

No servers: every trial is simulated with the simulator's pure model (`workers.simulator.model`):
start-up seconds and memory check for the launched server, throughput and accept length per
concurrency level from `predict`, with the simulator's noise model (per-request lognormal timing
noise averaged over the workload, acceptance sampling noise, a per-host offset that cancels
against the same host's baseline, and a slow drift over simulated wall time, so a trial measured
hours after its baseline carries up to ~1% of drift).

Strategies, each on every landscape and seed:

* `spectune` - the service's own loop: `sampler: auto` (optimizer.model_sampler), SGLang's
  defaults as warm start, canonical de-duplication, OOM regions inferred from failures (no
  launch), CUDA graphs captured for the workload's levels only (optimizer.plan).
* `tpe` - Optuna's default TPESampler() over the raw space (steps 1-10, topk {1,2,4,8}, draft
  tokens 2-64 as independent integers), no domain knowledge: every proposal is launched (a tree
  SGLang cannot fill fails at the first verify, after the start-up), failures are told as 0,
  SGLang's default graph capture up to the largest level.
* `random` - uniform over the valid canonical configurations, without repeats.
* `grid` - SGLang's `bench_speculative.py` grid: steps 1,3,5,7 x topk 1,2,4,8 x draft tokens
  2,4,8,16,32, valid points only, in its loop order, each point a fresh server (as it does).

Measured per run: launches until a launched configuration's true objective is within 2% of the
true optimum, the simulated GPU-hours spent until then (start-up + benchmark, x GPUs), and the
true objective of the configuration each strategy would *report* (best measured) after 10, 20
and 40 launches, as a share of the optimum.  One baseline is measured first in every run.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna

from optimizer import study as opt
from optimizer.infeasible import known_to_fail, oom_points
from optimizer.objective import LevelResult, score
from optimizer.plan import server_settings
from optimizer.space import SearchSpace, SpecConfig, max_draft_tokens
from optimizer.spec import StudySpec
from workers.simulator.landscapes import LANDSCAPES, Landscape
from workers.simulator.model import (
    InfeasibleConfigError,
    NoiseModel,
    check_memory,
    predict,
    startup_seconds,
)

WITHIN = 0.98
BUDGETS = (10, 20, 40)
GRID_STEPS = (1, 3, 5, 7)
GRID_TOPK = (1, 2, 4, 8)
GRID_NDT = (2, 4, 8, 16, 32)
STRATEGIES = ("spectune", "tpe", "random", "grid")


@dataclass(frozen=True)
class Workload:
    levels: tuple[int, ...]
    num_prompts: int = 64
    output_len: int = 256
    repeats: int = 3
    warmup_s: float = 10.0


@dataclass(frozen=True)
class Plan:
    """How a strategy launches servers: graph capture and the request cap."""

    max_running_requests: int
    cuda_graph_bs: tuple[int, ...] | None = None
    cuda_graph_max_bs: int | None = None


@dataclass
class Host:
    """One simulated GPU host: its clock, noise and baseline (re-measured every 6 h)."""

    landscape: Landscape
    workload: Workload
    plan: Plan
    rng: random.Random
    seed: int
    noise: NoiseModel = field(default_factory=NoiseModel)
    clock_s: float = 0.0
    gpu_s: float = 0.0
    baseline: list[dict[str, Any]] = field(default_factory=list)
    baseline_at: float = -1e18

    def __post_init__(self) -> None:
        self.clock_s = self.rng.uniform(0, 24 * 3600)
        self.start_clock = self.clock_s

    def _measure(self, config: SpecConfig | None) -> list[dict[str, Any]]:
        ls, wl, p = self.landscape, self.workload, self.plan
        out = []
        drift = self.noise.drift_factor(self.seed, "host", self.clock_s)
        for c in wl.levels:
            pr = predict(
                ls,
                config,
                c,
                max_running_requests=p.max_running_requests,
                cuda_graph_bs=p.cuda_graph_bs,
                cuda_graph_max_bs=p.cuda_graph_max_bs,
            )
            tokens = wl.num_prompts * wl.output_len
            cycles = tokens / pr.accept_length
            # Acceptance sampling: tokens per cycle vary by ~their own size; averaged over cycles.
            al = pr.accept_length * math.exp(self.rng.gauss(0, 0.5 / math.sqrt(cycles)) if config else 0.0)
            runs = []
            for _ in range(wl.repeats):
                timing = math.exp(self.rng.gauss(0, self.noise.sigma / math.sqrt(wl.num_prompts)))
                runs.append(pr.output_tok_s * (al / pr.accept_length) / (timing * drift))
            tok_s = statistics.fmean(runs)
            out.append(
                {
                    "concurrency": c,
                    "output_tok_s": tok_s,
                    "output_tok_s_runs": runs,
                    "per_user_tok_s": tok_s / pr.batch_size,
                    "accept_length": al if config is not None else None,
                }
            )
            self._spend(wl.repeats * tokens / tok_s)
        return out

    def _spend(self, seconds: float) -> None:
        self.clock_s += seconds
        self.gpu_s += seconds * self.landscape.tp_size

    def _start(self, config: SpecConfig | None) -> None:
        p = self.plan
        self._spend(
            startup_seconds(
                self.landscape,
                config,
                max_running_requests=p.max_running_requests,
                cuda_graph_bs=p.cuda_graph_bs,
                cuda_graph_max_bs=p.cuda_graph_max_bs,
            )
            + self.workload.warmup_s
        )

    def baseline_levels(self) -> list[dict[str, Any]]:
        if self.clock_s - self.baseline_at > 6 * 3600:
            self._start(None)
            self.baseline = self._measure(None)
            self.baseline_at = self.clock_s
        return self.baseline

    def launch(self, config: SpecConfig) -> tuple[str, list[dict[str, Any]]]:
        """('ok', levels) | ('oom', []) | ('invalid', [])."""
        p = self.plan
        mem = check_memory(
            self.landscape,
            config,
            max_running_requests=p.max_running_requests,
            cuda_graph_bs=p.cuda_graph_bs,
            cuda_graph_max_bs=p.cuda_graph_max_bs,
        )
        if not mem.ok:
            # Capture fails near its end: most of the start-up is spent.
            self._spend(0.9 * startup_seconds(self.landscape, config, max_running_requests=p.max_running_requests))
            return "oom", []
        c = config.canonical()
        if c.num_draft_tokens > max_draft_tokens(c.num_steps, c.topk):
            self._start(config)
            return "invalid", []
        self._start(config)
        return "ok", self._measure(config)


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
        mem = check_memory(self.ls, c, max_running_requests=p.max_running_requests, cuda_graph_bs=p.cuda_graph_bs)
        if mem.ok and c.num_draft_tokens <= max_draft_tokens(c.num_steps, c.topk):
            logs = []
            for lvl in self.wl.levels:
                base = predict(self.ls, None, lvl, max_running_requests=p.max_running_requests).output_tok_s
                try:
                    tok = predict(
                        self.ls, c, lvl, max_running_requests=p.max_running_requests, cuda_graph_bs=p.cuda_graph_bs
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


def spectune_plan(spec: StudySpec) -> Plan:
    s = server_settings(spec, SpecConfig(num_steps=1, topk=1, num_draft_tokens=2))
    return Plan(s.max_running_requests, s.cuda_graph_bs, s.cuda_graph_max_bs)


def run_spectune(host: Host, truth: Truth, spec: StudySpec, max_launches: int) -> Run:
    """The service's loop (api.services.leasing) without the database."""
    run = Run()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.InMemoryStorage()
    opt.create_study(storage, spec)
    launched: dict[str, int] = {}
    asks = 0
    while len(run.truths) < max_launches and asks < 4 * max_launches:
        asks += 1
        study = opt.load_study(storage, spec)
        asked = opt.ask(study, spec)
        key = asked.config.key
        trials = study.get_trials(deepcopy=False)
        if key in launched:
            prior = opt.get_trial(study, launched[key])
            if prior.value is not None:
                opt.tell_value(study, asked.number, prior.value, 0.0, {"duplicate_of": prior.number, "config_key": key})
            else:
                opt.tell_failed(study, asked.number, {"duplicate_of": prior.number})
            continue
        proof = known_to_fail(asked.config, oom_points(trials))
        attrs: dict[str, Any] = {"config": asked.config.model_dump(mode="json"), "config_key": key}
        if proof is not None:
            opt.tell_infeasible(
                study, asked.number, attrs | {"inferred_from": proof.trial_number, "failure_kind": "oom"}
            )
            continue
        base = host.baseline_levels()
        outcome, levels = host.launch(asked.config)
        launched[key] = asked.number
        if outcome != "ok":
            opt.tell_infeasible(study, asked.number, attrs | {"failure_kind": "oom" if outcome == "oom" else "crash"})
            run.add(0.0, 0.0, host.gpu_s)
            continue
        sc = score(
            spec.objective,
            [LevelResult(lv["concurrency"], lv["output_tok_s"]) for lv in levels],
            {b["concurrency"]: b["output_tok_s"] for b in base},
        )
        opt.tell_value(study, asked.number, sc.value, 0.0, attrs | {"levels": levels, "baseline_levels": base})
        run.add(truth.value(asked.config), sc.value, host.gpu_s)
    return run


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


def run_random(host: Host, truth: Truth, space: SearchSpace, rng: random.Random, max_launches: int) -> Run:
    run = Run()
    configs = list(space.iter_configs())
    rng.shuffle(configs)
    for config in configs[:max_launches]:
        outcome, value = _measured_value(host, config)
        run.add(truth.value(config) if outcome == "ok" else 0.0, value, host.gpu_s)
    return run


def grid_points() -> list[SpecConfig]:
    out = []
    for steps in GRID_STEPS:
        for topk in GRID_TOPK:
            for ndt in GRID_NDT:
                if ndt <= steps * topk + 1:
                    out.append(SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=ndt))
    return out


def run_grid(host: Host, truth: Truth) -> Run:
    run = Run()
    for config in grid_points():
        outcome, value = _measured_value(host, config)
        run.add(truth.value(config) if outcome == "ok" else 0.0, value, host.gpu_s)
    return run


@dataclass
class Cell:
    trials: list[float] = field(default_factory=list)  # inf when never within 2%
    gpu_h: list[float] = field(default_factory=list)
    total_gpu_h: list[float] = field(default_factory=list)
    reported: dict[int, list[float]] = field(default_factory=lambda: {b: [] for b in BUDGETS})


def simulate(landscape: Landscape, workload: Workload, seeds: int, max_launches: int) -> dict[str, Cell]:
    space = SearchSpace()
    cells = {s: Cell() for s in STRATEGIES}
    top = max(workload.levels)
    default_plan = Plan(max_running_requests=top, cuda_graph_max_bs=top)
    for seed in range(seeds):
        spec = spec_for(workload, "auto", seed)
        plans = {"spectune": spectune_plan(spec), "tpe": default_plan, "random": default_plan, "grid": default_plan}
        truth = Truth(landscape, workload, plans["spectune"], space)
        for name in STRATEGIES:
            host = Host(landscape, workload, plans[name], random.Random(f"{landscape.name}/{seed}/host"), seed)
            rng = random.Random(f"{landscape.name}/{seed}/{name}")
            if name == "spectune":
                # It reaches 2% within a few trials; the largest budget reported is enough.
                run = run_spectune(host, truth, spec, min(max_launches, max(BUDGETS)))
            elif name == "tpe":
                run = run_tpe(host, truth, seed, max_launches)
            elif name == "random":
                run = run_random(host, truth, space, rng, max_launches)
            else:
                run = run_grid(host, truth)
            n, gpu_s = run.to_within(truth.optimum)
            cell = cells[name]
            cell.trials.append(math.inf if n is None else n)
            cell.gpu_h.append(math.inf if gpu_s is None else gpu_s / 3600)
            cell.total_gpu_h.append(run.gpu_s[-1] / 3600 if run.gpu_s else 0.0)
            for b in BUDGETS:
                cell.reported[b].append(run.reported(b) / truth.optimum if truth.optimum > 0 else 0.0)
    return cells


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _fmt(x: float, digits: int = 1) -> str:
    if math.isinf(x):
        return "never"
    return f"{x:.{digits}f}"


def report(name: str, cells: dict[str, Cell], seeds: int, max_launches: int) -> list[str]:
    lines = [f"### {name}", ""]
    lines.append(
        "| strategy | median trials to 2% | reached | median GPU-h to 2% | GPU-h of the run | "
        + " | ".join(f"reported @{b}" for b in BUDGETS)
        + " |"
    )
    lines.append("|---" * (5 + len(BUDGETS)) + "|")
    for s in STRATEGIES:
        c = cells[s]
        reached = sum(1 for t in c.trials if not math.isinf(t))
        lines.append(
            f"| {s} | {_fmt(_median(c.trials))} | {reached}/{seeds} | {_fmt(_median(c.gpu_h), 2)} | "
            f"{_fmt(_median(c.total_gpu_h), 2)} | "
            + " | ".join(f"{100 * statistics.fmean(c.reported[b]):.1f}%" for b in BUDGETS)
            + " |"
        )
    sp = cells["spectune"]
    t_sp, h_sp = _median(sp.trials), _median(sp.gpu_h)
    t_tpe = _median(cells["tpe"].trials)
    grid_h = _median(cells["grid"].total_gpu_h)
    grid_to = _median(cells["grid"].gpu_h)
    lines.append("")
    lines.append(
        f"spectune / tpe trials: {_ratio(t_sp, t_tpe, max_launches)}; spectune / random trials: "
        f"{_ratio(t_sp, _median(cells['random'].trials), max_launches)}; spectune GPU-h to 2% / whole grid: "
        f"{h_sp / grid_h:.2f} (/ grid's own GPU-h to 2%: {'grid never reached 2%' if math.isinf(grid_to) else f'{h_sp / grid_to:.2f}'})"
    )
    ok = t_sp <= 10 and (math.isinf(t_tpe) or t_sp <= 0.5 * t_tpe) and h_sp <= grid_h / 3
    lines.append(
        f"targets (median <= 10 trials, <= 1/2 of TPE, <= 1/3 of the grid's GPU-h): {'met' if ok else 'MISSED'}"
    )
    lines.append("")
    return lines


def _ratio(a: float, b: float, cap: int) -> str:
    if math.isinf(a) and math.isinf(b):
        return "n/a (neither reached 2%)"
    if math.isinf(a):
        return "spectune never reached 2%"
    if math.isinf(b):
        return f"< {a / cap:.2f} (the other did not reach 2% within {cap} launches in most runs)"
    return f"{a / b:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--levels", default="1", help="workload concurrency levels, comma-separated")
    ap.add_argument("--landscapes", default=",".join(LANDSCAPES))
    ap.add_argument("--max-launches", type=int, default=60, help="launches per run (TPE and random)")
    ap.add_argument("--quick", action="store_true", help="40 launches per run")
    args = ap.parse_args(argv)
    levels = tuple(int(x) for x in args.levels.split(","))
    workload = Workload(levels=levels)
    max_launches = 40 if args.quick else args.max_launches
    t0 = time.monotonic()
    out = [
        f"search efficiency: levels {list(levels)}, {args.seeds} seeds, up to {max_launches} launches per run",
        "",
    ]
    for name in args.landscapes.split(","):
        ls = LANDSCAPES[name]
        cells = simulate(ls, workload, args.seeds, max_launches)
        lines = report(name, cells, args.seeds, max_launches)
        print("\n".join(lines), flush=True)
        out += lines
    print(f"({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
