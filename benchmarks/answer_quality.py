"""Can the answer be trusted?  Issue 17's "Must show" figures, measured.  (Run by hand.)

    python benchmarks/answer_quality.py                 # every case, 10/10/20 seeds (minutes)
    python benchmarks/answer_quality.py --cases coverage --seeds 5

No servers: each launch is the simulator's pure model (`spectune_sim.model`) on simulated hosts
(benchmarks/search_efficiency.Host), with one more noise the simulator's engine does not have: a
launch-to-launch factor (each start draws a lognormal offset of `--launch-sd` that every pass of
that launch shares), which the passes of one launch cannot show.

The study is the service's answer pipeline on two hosts: the search (sampler `auto`, the
convergence stop), then confirmation of the candidates whose intervals overlap the leader's,
each on the other host right after one fresh baseline per host, each launched *as it would be
deployed* (optimizer.deploy.deployment_envelopes: the printed envelope first, then a smaller
graph envelope where serving allows; a failed start is counted, the next envelope tried);
extra passes on the warm server while the interval straddles a decision
(workers/resolve.resolve, with the order the API sends); the launch noise estimated from the
study's own re-launches (optimizer.confirmation.study_noise); the winner the cheapest of the
candidates tied with the best (confirmation.choose); "pays" when its interval clears 1.0.

Cases:

* `memory-tight`: the deploy-tight engine, objective at concurrency 16, `serving:
  {max_running_requests: 48}` (issue 17's 14B-on-48 GB study).  Checked: the printed command
  starts (the answer's envelope passes the simulator's memory check), and its true speed is
  within 3% of the best deployable configuration (the best true objective among configurations
  some allowed envelope starts).
* `small-gain`: moe-pcie's engine with acceptance x0.93 (true best ~4.8% at concurrency 1).
  Checked: "pays" with a configuration within 1% of the best; extra passes counted.
* `coverage`: moe-pcie at concurrency 1 (the seed case).  Checked: the answer's true speedup
  lies in its reported 95% interval; launches to the answer (median <= 12).
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
from dataclasses import dataclass, field
from typing import Any

import optuna

from benchmarks.search_efficiency import Host, Plan, Truth, Workload, spectune_plan
from optimizer import confirmation as confirm
from optimizer import convergence, deploy
from optimizer import study as opt
from optimizer.attrs import TrialRecord
from optimizer.infeasible import known_to_fail, oom_points
from optimizer.objective import LevelResult, score
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from spectune_protocol import LevelMetrics, Resolve
from spectune_sim.landscapes import LANDSCAPES, Landscape
from spectune_sim.model import check_memory
from workers.resolve import resolve

# The share within which the cheapest tied candidate is preferred (None: the spec's min_gain).
TIE_WITHIN: float | None = None


@dataclass
class NoisyHost(Host):
    """A simulated host whose every launch also draws a launch-to-launch factor."""

    launch_sd: float = 0.01
    factor: float = 1.0
    baselines: list[list[dict[str, Any]]] = field(default_factory=list)

    def _start(self, config: SpecConfig | None) -> None:
        super()._start(config)
        self.factor = math.exp(self.rng.gauss(0.0, self.launch_sd))

    def _measure(self, config: SpecConfig | None) -> list[dict[str, Any]]:
        levels = super()._measure(config)
        for lv in levels:
            lv["output_tok_s"] *= self.factor
            lv["output_tok_s_runs"] = [r * self.factor for r in lv["output_tok_s_runs"]]
        return levels

    def baseline_levels(self, *, fresh: bool = False) -> list[dict[str, Any]]:
        before = self.launches.get("baseline", 0)
        out = super().baseline_levels(fresh=fresh)
        if self.launches.get("baseline", 0) != before:
            self.baselines.append(out)
        return out

    def launch_with(self, settings: Any) -> tuple[str, list[dict[str, Any]]]:
        """Launch `settings` (its envelope, not the study's tuning plan)."""
        saved = self.plan
        self.plan = Plan(settings.max_running_requests, settings.cuda_graph_bs, settings.cuda_graph_max_bs)
        try:
            return self.launch(settings.speculative)
        finally:
            self.plan = saved

    def more_passes(self, config: SpecConfig, passes: int) -> list[dict[str, Any]]:
        """More timed passes on the running server: no start-up, the same launch factor."""
        saved = self.workload
        self.workload = dataclasses.replace(saved, repeats=passes)
        try:
            return self._measure(config)
        finally:
            self.workload = saved


@dataclass
class Outcome:
    pays: bool
    truth: float  # true objective of the answer (1.0 without speculation)
    best: float  # the best the case allows (best deployable, at least 1.0)
    covered: bool | None  # the answer's true speedup inside its reported interval
    interval: tuple[float, float] | None
    value: float | None
    launches: int
    by_kind: dict[str, int]
    extra_passes: int
    started: bool  # the printed command started (its envelope passes the memory check)
    envelope_note: str
    tie_note: str | None
    noise_sd: float


def _tell(study: optuna.Study, number: int, attrs: dict[str, Any]) -> None:
    """Tell Optuna a search launch's result as the service does (infeasible, or the objective's score)."""
    if attrs.pop("_failed", False):
        opt.tell_infeasible(study, number, attrs)
        return
    spec = StudySpec.model_validate(study.user_attrs[opt.SPEC_ATTR])
    sc = score(
        spec.objective,
        [LevelResult(lv["concurrency"], lv["output_tok_s"]) for lv in attrs["levels"]],
        {b["concurrency"]: b["output_tok_s"] for b in attrs["baseline_levels"]},
    )
    opt.tell_value(study, number, sc.value, sc.violation, attrs)


def _spec(levels: Sequence[int], seed: int, serving: dict[str, int] | None, objective: int | None) -> StudySpec:
    doc: dict[str, Any] = {
        "name": "answer",
        "model": {"target": "t", "draft": "d"},
        "workload": {"concurrency": list(levels), "num_prompts": 64, "output_len": 256, "repeats": 3},
        "seed": seed,
    }
    if serving is not None:
        doc["serving"] = serving
    if objective is not None:
        doc["objective"] = {"concurrency": objective}
    return StudySpec.model_validate(doc)


def _starts(ls: Landscape, settings: Any) -> bool:
    return check_memory(
        ls,
        settings.speculative,
        max_running_requests=settings.max_running_requests,
        cuda_graph_max_bs=settings.cuda_graph_max_bs,
        cuda_graph_bs=settings.cuda_graph_bs,
    ).ok


def best_deployable(ls: Landscape, spec: StudySpec, truth: Truth) -> float:
    """The best true objective among configurations some allowed deployment envelope starts."""
    best = 1.0
    for c in spec.search_space.iter_configs():
        v = truth.value(c)
        if v > best and any(_starts(ls, e.settings) for e in deploy.deployment_envelopes(spec, c)):
            best = v
    return best


def run_case(ls: Landscape, spec: StudySpec, seed: int, launch_sd: float, best: float, truth: Truth) -> Outcome:
    wl = Workload(levels=tuple(spec.workload.concurrency))
    plan = spectune_plan(spec)
    hosts = [
        NoisyHost(ls, wl, plan, random.Random(f"{ls.name}/{seed}/{k}"), seed, host_id=f"h{k}", launch_sd=launch_sd)
        for k in range(2)
    ]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.InMemoryStorage()
    opt.create_study(storage, spec)
    launched: dict[str, int] = {}
    settled: convergence.Assessment | None = None
    for h in hosts:
        h.baseline_levels()
    for _ in range(8 * spec.budget.max_trials):  # bounded: every turn asks once
        if (settled is not None and settled.settled) or len(launched) >= spec.budget.max_trials:
            break
        h = min(hosts, key=lambda x: x.clock_s)
        study = opt.load_study(storage, spec)
        asked = opt.ask(study, spec)
        key = asked.config.key
        if key in launched:
            prior = opt.get_trial(study, launched[key])
            if prior.value is not None:
                opt.tell_value(study, asked.number, prior.value, 0.0, {"duplicate_of": prior.number, "config_key": key})
            else:
                opt.tell_failed(study, asked.number, {"duplicate_of": prior.number})
            continue
        attrs: dict[str, Any] = {"config": asked.config.model_dump(mode="json"), "config_key": key}
        proof = known_to_fail(asked.config, oom_points(study.get_trials(deepcopy=False)))
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
            attrs |= {"levels": levels, "baseline_levels": base, "worker_id": h.host_id}
        _tell(study, asked.number, attrs)
        if spec.budget.converge:
            settled = convergence.assess(spec, opt.load_study(storage, spec).get_trials(deepcopy=False))
    trials = opt.load_study(storage, spec).get_trials(deepcopy=False)
    return _confirm_and_answer(ls, spec, hosts, trials, settled, best, truth)


def _confirm_and_answer(
    ls: Landscape,
    spec: StudySpec,
    hosts: list[NoisyHost],
    trials: Sequence[optuna.trial.FrozenTrial],
    settled: convergence.Assessment | None,
    best: float,
    truth: Truth,
) -> Outcome:
    def baselines() -> list[tuple[str, Sequence[dict[str, Any]]]]:
        return [(h.host_id, b) for h in hosts for b in h.baselines]

    measurements: list[tuple[str, Sequence[dict[str, Any]], Sequence[dict[str, Any]]]] = []
    docs: list[dict[str, Any]] = []
    extra_total = 0
    if not (settled is not None and settled.settled and settled.pays is False):
        noise = confirm.study_noise(trials, baselines(), measurements)
        chosen = confirm.candidates(trials, spec.confirmation.top, spec, noise.variance)
        fresh: set[str] = set()
        failed: list[tuple[SpecConfig, int]] = []
        for t in chosen:
            r = TrialRecord(t)
            cfg = r.config
            others = [h for h in hosts if h.host_id != r.worker_id] or hosts
            h = min(others, key=lambda x: x.clock_s)
            h.kind = "confirm"
            if h.host_id not in fresh:
                h.baseline_levels(fresh=True)
                fresh.add(h.host_id)
            base = h.baseline
            for tier, env in deploy.envelopes_to_try(spec, cfg, failed):
                outcome, levels = h.launch_with(env.settings)
                if outcome == "ok":
                    break
                if outcome == "oom":
                    failed.append((cfg, tier))
            else:
                continue  # no deployment of it started: it cannot be the answer
            noise = confirm.study_noise(trials, baselines(), measurements)
            order = Resolve(
                levels=list(spec.workload.concurrency),
                objective_concurrency=spec.objective.concurrency,
                baseline_runs={str(b["concurrency"]): b["output_tok_s_runs"] for b in base},
                thresholds=sorted({1.0, 1.0 + spec.budget.min_gain, *(float(d["speedup"]) for d in docs)})[:16],
                extra_var=noise.variance,
                max_passes=confirm.EXTRA_PASSES_PER_REPEAT * spec.workload.repeats,
            )
            metrics = [LevelMetrics.model_validate(lv) for lv in levels]

            def measure(cs: list[int], k: int, h: NoisyHost = h, cfg: SpecConfig = cfg) -> list[LevelMetrics]:
                return [LevelMetrics.model_validate(lv) for lv in h.more_passes(cfg, k) if lv["concurrency"] in cs]

            merged, extra, _ = resolve(order, metrics, spec.workload.repeats, measure)
            extra_total += extra
            final = [m.model_dump(mode="json") for m in merged]
            measurements.append((cfg.key, final, base))
            docs.append({"trial_number": t.number, "config": cfg.model_dump(mode="json"), "levels": final,
                         "base": base, "envelope": env,
                         "speedup": confirm.confirm_result(spec, final, base).value})  # fmt: skip
    by_kind: dict[str, int] = {}
    for h in hosts:
        for k, v in h.launches.items():
            by_kind[k] = by_kind.get(k, 0) + v
    by_kind.pop("oom", None)
    launches = sum(by_kind.values())
    noise = confirm.study_noise(trials, baselines(), measurements)
    for d in docs:
        r = confirm.confirm_result(spec, d["levels"], d["base"], noise.variance)
        d["speedup"] = r.value
        d["speedup_interval"] = None if r.interval is None else {"low": r.interval.low, "high": r.interval.high}
    if not docs:
        base_started = _starts(ls, deploy.deployment_settings(spec, None)[0])
        return Outcome(False, 1.0, best, None, None, None, launches, by_kind, extra_total, base_started, "", None,
                       noise.sd)  # fmt: skip
    choice = confirm.choose(docs, spec.budget.min_gain if TIE_WITHIN is None else TIE_WITHIN)
    w = choice.winner
    iv = w["speedup_interval"]
    pays = iv is not None and iv["low"] > 1.0
    true = truth.value(SpecConfig.model_validate(w["config"]))
    covered = None if iv is None else iv["low"] <= true <= iv["high"]
    env = w["envelope"]
    started = _starts(ls, env.settings) if pays else _starts(ls, deploy.deployment_settings(spec, None)[0])
    return Outcome(
        pays, true if pays else 1.0, best, covered, None if iv is None else (iv["low"], iv["high"]), w["speedup"],
        launches, by_kind, extra_total, started, env.note, choice.note, noise.sd,
    )  # fmt: skip


def small_gain() -> Landscape:
    m = LANDSCAPES["moe-pcie"]
    return dataclasses.replace(
        m, name="small-gain", accept_by_depth=tuple(a * 0.93 for a in m.accept_by_depth), calibration=()
    )


CASES: dict[str, tuple[Landscape, tuple[int, ...], dict[str, int] | None, int | None, int]] = {
    # name: landscape, levels, serving, objective level, default seeds
    "memory-tight": (LANDSCAPES["deploy-tight"], (16,), {"max_running_requests": 48}, None, 10),
    "small-gain": (small_gain(), (1,), None, None, 10),
    "coverage": (LANDSCAPES["moe-pcie"], (1,), None, None, 20),
}


def run(case: str, seeds: int, launch_sd: float) -> list[Outcome]:
    ls, levels, serving, objective, _ = CASES[case]
    out = []
    for seed in range(seeds):
        spec = _spec(levels, seed, serving, objective)
        truth = Truth(ls, Workload(levels=levels), spectune_plan(spec), spec.search_space)
        best = best_deployable(ls, spec, truth)
        out.append(run_case(ls, spec, seed, launch_sd, best, truth))
    return out


def report(case: str, outs: Sequence[Outcome]) -> list[str]:
    n = len(outs)
    launches = sorted(o.launches for o in outs)
    lines = [f"## {case} ({n} seeds)"]
    lines.append(
        f"launches to the answer: median {statistics.median(launches):g}, max {launches[-1]} "
        f"(by kind, summed: {_sum_kinds(outs)})"
    )
    pays = sum(o.pays for o in outs)
    near = sum(o.pays and o.truth >= o.best * 0.99 for o in outs)
    within3 = sum(o.truth >= o.best * 0.97 for o in outs)
    started = sum(o.started for o in outs)
    covered = [o.covered for o in outs if o.covered is not None]
    lines.append(f"verdict 'pays': {pays}/{n}; pays with a configuration within 1% of the best: {near}/{n}")
    lines.append(f"answer within 3% of the best deployable: {within3}/{n}; printed command starts: {started}/{n}")
    lines.append(f"true speedup inside the reported 95% interval: {sum(covered)}/{len(covered)}")
    lines.append(
        f"extra passes on warm servers: {sum(o.extra_passes for o in outs)} in total "
        f"({sum(o.extra_passes > 0 for o in outs)} studies); launch noise estimated (median sd) "
        f"{statistics.median(o.noise_sd for o in outs):.4f}"
    )
    for i, o in enumerate(outs):
        iv = "-" if o.interval is None else f"[{o.interval[0]:.3f}-{o.interval[1]:.3f}]"
        lines.append(
            f"  seed {i}: {'pays' if o.pays else 'no  '} value {o.value or 0:.3f} {iv} true {o.truth:.3f} "
            f"best {o.best:.3f} launches {o.launches} extra {o.extra_passes}"
            f"{' envelope: ' + o.envelope_note if o.envelope_note else ''}{' tie' if o.tie_note else ''}"
        )
    return lines


def _sum_kinds(outs: Sequence[Outcome]) -> str:
    total: dict[str, int] = {}
    for o in outs:
        for k, v in o.by_kind.items():
            total[k] = total.get(k, 0) + v
    return ", ".join(f"{k} {v}" for k, v in sorted(total.items()))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--seeds", type=int, default=None, help="seeds per case (default: 10, 10, 20)")
    ap.add_argument("--launch-sd", type=float, default=0.01, help="launch-to-launch sd of a launch's throughput")
    ap.add_argument(
        "--tie-within", type=float, default=None, help="prefer the cheapest tied candidate within this share"
    )
    args = ap.parse_args(argv)
    global TIE_WITHIN
    TIE_WITHIN = args.tie_within
    t0 = time.monotonic()
    for case in args.cases.split(","):
        outs = run(case, args.seeds or CASES[case][4], args.launch_sd)
        print("\n".join(report(case, outs)), flush=True)
    print(f"({time.monotonic() - t0:.0f} s; launch-to-launch sd {args.launch_sd})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
