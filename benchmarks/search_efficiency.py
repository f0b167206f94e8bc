"""Launches and GPU-hours until a study declares its answer, per strategy.  (Run by hand.)

    python benchmarks/search_efficiency.py                      # 6 landscapes x 20 seeds (minutes)
    python benchmarks/search_efficiency.py --seeds 5            # a smoke run
    python benchmarks/search_efficiency.py --levels 1,64        # one workload for every landscape

No servers: every launch is simulated with the simulator's pure model (`spectune_sim.model`):
start-up seconds and memory check of the server launched, throughput and accept length per
concurrency level from `predict`, with the simulator's noise model (per-request lognormal timing
noise averaged over the workload, acceptance sampling noise, a per-host offset that cancels
against the same host's baseline, and a slow drift over simulated wall time).

Strategies, each on every landscape and seed:

* `default` - the service's own loop with the default study (`sampler: auto`, convergence stop
  on, `min_gain` 1%, confirmation of the top 3 whose intervals overlap the leader's), two
  workers on two hosts leasing in the order of their clocks, so proposals are made while the
  other host's trial is in flight; the study declares its answer when it converges (or
  `max_trials` = 30), then confirms (one fresh baseline per host, baseline-candidate-baseline
  only where drift was seen).  A "speculation does not pay" verdict is not confirmed.
* `budget20` - the same loop with the convergence stop off and `max_trials: 20` (the behaviour
  the issue reported: the whole budget is spent, then confirmation).
* `tpe` - Optuna's default TPESampler() over the raw space (steps 1-10, topk {1,2,4,8}, draft
  tokens 2-64 as independent integers), 20 launches on one host; no domain knowledge: every
  proposal is launched (a tree SGLang cannot fill fails after its start-up), failures told as 0,
  SGLang's default graph capture up to the largest level; its answer is the best measured.
* `grid` - SGLang's `bench_speculative.py` grid (optimizer.costs.grid_points), each point a
  fresh server; its answer is the best measured.

Everything is counted: baselines (re-measured every 6 h of simulated time, and the fresh ones
of the confirmation), search launches, confirmations, failed launches.  GPU-hours = (start-up +
warm-up + benchmark) x the landscape's GPUs.  The answer's share = its true objective / the true
optimum, where "run without speculation" counts as 1.0x and the optimum is at least 1.0x.
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

from optimizer import confirmation, convergence, costs
from optimizer import study as opt
from optimizer.infeasible import known_to_fail, oom_points
from optimizer.objective import LevelResult, score
from optimizer.plan import server_settings
from optimizer.space import SearchSpace, SpecConfig, max_draft_tokens
from optimizer.spec import StudySpec
from spectune_sim.landscapes import LANDSCAPES, Landscape
from spectune_sim.model import (
    InfeasibleConfigError,
    NoiseModel,
    check_memory,
    predict,
    startup_seconds,
)

WITHIN = 0.98
TRACE = False


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
    host_id: str = "host"
    clock_s: float = 0.0
    gpu_s: float = 0.0
    baseline: list[dict[str, Any]] = field(default_factory=list)
    baseline_at: float = -1e18
    # Launches and GPU-seconds by kind: baseline, search, confirm, failed.
    launches: dict[str, int] = field(default_factory=dict)
    gpu_by_kind: dict[str, float] = field(default_factory=dict)
    kind: str = "search"
    last_startup_s: float = 0.0

    def __post_init__(self) -> None:
        self.noise = self.noise.scaled(self.landscape.noise_scale)
        self.clock_s = self.rng.uniform(0, 24 * 3600)
        self.start_clock = self.clock_s

    def count(self, kind: str, gpu_s_before: float) -> None:
        self.launches[kind] = self.launches.get(kind, 0) + 1
        self.gpu_by_kind[kind] = self.gpu_by_kind.get(kind, 0.0) + self.gpu_s - gpu_s_before

    def _measure(self, config: SpecConfig | None) -> list[dict[str, Any]]:
        ls, wl, p = self.landscape, self.workload, self.plan
        out = []
        drift = self.noise.drift_factor(self.seed, self.host_id, self.clock_s) * self.noise.host_factor(
            self.seed, self.host_id
        )
        if config is not None:
            drift *= self.noise.spec_host_factor(self.seed, self.host_id)
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
        self.last_startup_s = startup_seconds(
            self.landscape,
            config,
            max_running_requests=p.max_running_requests,
            cuda_graph_bs=p.cuda_graph_bs,
            cuda_graph_max_bs=p.cuda_graph_max_bs,
        )
        self._spend(self.last_startup_s + self.workload.warmup_s)

    def baseline_levels(self, *, fresh: bool = False) -> list[dict[str, Any]]:
        if fresh or self.clock_s - self.baseline_at > 6 * 3600:
            before = self.gpu_s
            self._start(None)
            self.baseline = self._measure(None)
            self.baseline_at = self.clock_s
            self.count("baseline", before)
        return self.baseline

    def launch(self, config: SpecConfig) -> tuple[str, list[dict[str, Any]]]:
        """('ok', levels) | ('oom', []) | ('invalid', []), counted under `self.kind` or failed."""
        before = self.gpu_s
        outcome, levels = self._launch(config)
        self.count(self.kind if outcome == "ok" else "failed", before)
        if outcome == "oom":
            self.launches["oom"] = self.launches.get("oom", 0) + 1
        return outcome, levels

    def _launch(self, config: SpecConfig) -> tuple[str, list[dict[str, Any]]]:
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


def _answer(hosts: Sequence[Host], truth: Truth, value: float, reason: str) -> Answer:
    by_kind: dict[str, int] = {}
    gpu: dict[str, float] = {}
    for h in hosts:
        for k, v in h.launches.items():
            by_kind[k] = by_kind.get(k, 0) + v
        for k, g in h.gpu_by_kind.items():
            gpu[k] = gpu.get(k, 0.0) + g / 3600
    oom = by_kind.pop("oom", 0)
    best = max(truth.optimum, 1.0)
    return Answer(sum(by_kind.values()), by_kind, sum(gpu.values()), gpu, value / best, oom, reason)


def run_study(hosts: list[Host], truth: Truth, spec: StudySpec) -> Answer:
    """The service's loop (api.services.leasing / studies.maybe_finish) without the database.

    Workers (one per host) lease in the order their hosts' clocks say: a result is told when its
    host's clock is the earliest, so a worker asking meanwhile sees the other's trial in flight
    (RUNNING, as in the service).  After every result the study is assessed
    (optimizer.convergence, when `budget.converge`); once settled, or `max_trials` launched,
    no new trial is asked; when nothing is in flight the top candidates whose intervals overlap
    the leader's are confirmed, each host measuring one fresh baseline for all of its
    confirmations (and a baseline after each candidate only where it saw drift).
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.InMemoryStorage()
    opt.create_study(storage, spec)
    launched: dict[str, int] = {}
    pending: dict[int, tuple[float, int, dict[str, Any]]] = {}  # host index -> (done at, trial, attrs)
    settled = convergence.Assessment(False, "", 0, 0, 1.0, None, 1.0, None)
    asks = 0
    for h in hosts:
        h.kind = "search"
        h.baseline_levels()
    while True:
        # Deliver the earliest finished result first.
        if pending:
            i_next = min(pending, key=lambda i: pending[i][0])
            idle = [i for i in range(len(hosts)) if i not in pending]
            if not idle or min(hosts[i].clock_s for i in idle) >= pending[i_next][0]:
                _, number, attrs = pending.pop(i_next)
                study = opt.load_study(storage, spec)
                _tell(study, number, attrs)
                if spec.budget.converge:
                    settled = convergence.assess(spec, study.get_trials(deepcopy=False))
                    if TRACE:
                        print(
                            "   ", attrs.get("config_key"), attrs.get("failure_kind"), settled.reason, file=sys.stderr
                        )
                continue
        idle = [i for i in range(len(hosts)) if i not in pending]
        stop = settled.settled or len(launched) >= spec.budget.max_trials or asks > 8 * spec.budget.max_trials
        if stop:
            if pending:
                # Idle until the next result (which may unsettle the study).
                t_next = min(p[0] for p in pending.values())
                for i in idle:
                    hosts[i].clock_s = max(hosts[i].clock_s, t_next)
                continue
            break
        i = min(idle, key=lambda j: hosts[j].clock_s)
        h = hosts[i]
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
        h.kind = "search"
        base = h.baseline_levels()
        outcome, levels = h.launch(asked.config)
        launched[key] = asked.number
        if outcome != "ok":
            attrs |= {"failure_kind": "oom" if outcome == "oom" else "crash", "_failed": True}
        else:
            attrs |= {"levels": levels, "baseline_levels": base, "startup_s": h.last_startup_s}
        pending[i] = (h.clock_s, asked.number, attrs)
    study = opt.load_study(storage, spec)
    trials = study.get_trials(deepcopy=False)
    reason = settled.reason if settled.settled else f"max_trials={spec.budget.max_trials}"
    best = opt.best_trial_of(trials)
    if best is None:
        return _answer(hosts, truth, 1.0, reason)
    if settled.settled and settled.pays is False:
        return _answer(hosts, truth, 1.0, reason)  # "speculation does not pay": run the baseline
    chosen = confirmation.candidates(trials, spec.confirmation.top, spec)
    confirmed: list[tuple[float, SpecConfig]] = []
    began = max(h.clock_s for h in hosts)
    fresh_at: dict[int, float] = {}
    last_done: dict[int, float] = {}
    drift: dict[int, bool] = {}
    for t in chosen:
        cfg = SpecConfig.model_validate(t.user_attrs["config"])
        # One fresh baseline serves every confirmation on its host: keep to a host that has one.
        paired = [j for j in fresh_at if not drift.get(j, False)]
        i = paired[0] if paired else min(range(len(hosts)), key=lambda j: hosts[j].clock_s)
        h = hosts[i]
        h.clock_s = max(h.clock_s, began)
        earlier = h.baseline
        if not confirmation.baseline_serves(fresh_at.get(i, -1.0), began, last_done.get(i), drift.get(i, False)):
            h.kind = "confirm"
            base = h.baseline_levels(fresh=True)
            fresh_at[i] = h.clock_s
            if i not in drift:
                drift[i] = confirmation.drift_seen(base, earlier, 0.02)
        h.kind = "confirm"
        outcome, levels = h.launch(cfg)
        last_done[i] = h.clock_s
        if outcome == "ok":
            got = confirmation.confirm_result(spec, levels, h.baseline)
            confirmed.append((got.value, cfg))
    if confirmed:
        value, cfg = max(confirmed, key=lambda x: x[0])
        answer = truth.value(cfg) if value > 1.0 else 1.0
    else:
        answer = truth.value(SpecConfig.model_validate(best.user_attrs["config"]))
    return _answer(hosts, truth, answer, reason)


def _tell(study: optuna.Study, number: int, attrs: dict[str, Any]) -> None:
    if attrs.pop("_failed", False):
        opt.tell_infeasible(study, number, attrs)
        return
    spec = opt_spec(study)
    sc = score(
        spec.objective,
        [LevelResult(lv["concurrency"], lv["output_tok_s"]) for lv in attrs["levels"]],
        {b["concurrency"]: b["output_tok_s"] for b in attrs["baseline_levels"]},
    )
    opt.tell_value(study, number, sc.value, 0.0, attrs)


def opt_spec(study: optuna.Study) -> StudySpec:
    return StudySpec.model_validate(study.user_attrs[opt.SPEC_ATTR])


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
# The memory-bound landscapes are measured where memory binds: spectune captures graphs only for
# the workload's levels, so at level 1 nothing runs out of memory there.
LEVELS_BY_LANDSCAPE: dict[str, tuple[int, ...]] = {"mem-tight": (64,), "draft-mem-cliff": (16,)}


def _run_answer(hosts: Sequence[Host], truth: Truth, run: Run) -> Answer:
    best = max(truth.optimum, 1.0)
    n = len(run.measured)
    share = run.reported(n) / best if n and max(run.measured) > 1.0 else 1.0 / best
    return _answer(hosts, truth, share * best, "fixed")


def simulate_studies(landscape: Landscape, workload: Workload, seeds: int) -> dict[str, list[Answer]]:
    space = SearchSpace()
    out: dict[str, list[Answer]] = {s: [] for s in STUDY_STRATEGIES}
    top = max(workload.levels)
    default_plan = Plan(max_running_requests=top, cuda_graph_max_bs=top)
    for seed in range(seeds):
        spec = spec_for(workload, "auto", seed)
        plan = spectune_plan(spec)
        truth = Truth(landscape, workload, plan, space)
        for name in STUDY_STRATEGIES:

            def hosts_of(p: Plan, n: int, name: str = name, seed: int = seed) -> list[Host]:
                return [
                    Host(
                        landscape,
                        workload,
                        p,
                        random.Random(f"{landscape.name}/{seed}/{name}/{k}"),
                        seed,
                        host_id=f"h{k}",
                    )
                    for k in range(n)
                ]

            if name in ("default", "budget20"):
                hs = hosts_of(plan, 2)
                s = (
                    spec
                    if name == "default"
                    else spec.model_copy(
                        update={"budget": spec.budget.model_copy(update={"converge": False, "max_trials": 20})}
                    )
                )
                out[name].append(run_study(hs, truth, s))
            elif name == "tpe":
                hs = hosts_of(default_plan, 1)
                run = run_tpe(hs[0], truth, seed, 20)
                out[name].append(_run_answer(hs, truth, run))
            else:
                hs = hosts_of(default_plan, 1)
                run = run_grid(hs[0], truth)
                out[name].append(_run_answer(hs, truth, run))
    return out


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def study_report(name: str, levels: Sequence[int], cells: dict[str, list[Answer]], seeds: int) -> list[str]:
    lines = [
        f"### {name} (levels {list(levels)}, {seeds} seeds)",
        "",
        "| strategy | median launches to the answer | baselines / search / confirm / failed | median GPU-h | "
        "answer within 2% | median share of optimum | OOM launches (median / max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in STUDY_STRATEGIES:
        answers = cells[s]
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
    d = cells["default"]
    reasons: dict[str, int] = {}
    for a in d:
        key = a.reason.split(":")[0].split(" after")[0]
        reasons[key] = reasons.get(key, 0) + 1
    lines.append("")
    lines.append("default study ended by: " + ", ".join(f"{k} ({v})" for k, v in sorted(reasons.items())))
    lines.append("")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--levels", default=None, help="workload concurrency levels for every landscape, comma-separated")
    ap.add_argument("--landscapes", default=",".join(LANDSCAPES))
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    print(f"search efficiency: {args.seeds} seeds, two workers for the studies", flush=True)
    for name in args.landscapes.split(","):
        ls = LANDSCAPES[name]
        if args.levels:
            levels = tuple(int(x) for x in args.levels.split(","))
        else:
            levels = LEVELS_BY_LANDSCAPE.get(name, (1,))
        cells = simulate_studies(ls, Workload(levels=levels), args.seeds)
        print("\n".join(study_report(name, levels, cells, args.seeds)), flush=True)
    print(f"({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
