"""Can the answer be trusted?  Issue 17's "Must show" figures, measured.  (Run by hand.)

    python benchmarks/answer_quality.py                 # every case, 10/10/20 seeds (minutes)
    python benchmarks/answer_quality.py --cases coverage --seeds 5

No servers: each launch is the simulator's pure model (`spectune_sim.model`) on simulated hosts
(benchmarks/search_efficiency.Host), with one more noise the simulator's engine does not have: a
launch-to-launch factor (each start draws a lognormal offset of `--launch-sd` that every pass of
that launch shares), which the passes of one launch cannot show.

The study is the one the service runs, on two hosts: `benchmarks.search_efficiency.drive`
carries out `optimizer.conductor`'s actions on an in-memory store (the search with sampler
`auto` and the stop rule, the move to confirmation, each confirmation paired with a fresh
baseline on another host than the one that found it).  What a confirmation launches and measures
is the conductor's order too: the deployment as it would be printed (its `Candidate`'s envelope,
then `next_deployment` after an out-of-memory start: each failed start counted) and the extra
passes of its `Resolve` order on the warm server (workers/resolve.resolve), with the study's
launch noise (conductor.launch_noise, from its own re-launches).  The answer is the service's:
optimizer.answer.winner over the confirmations as api.services.studies documents them; "pays" when
its interval clears 1.0.

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
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from benchmarks.search_efficiency import Truth, add_policy_flag, drive, policy_of
from optimizer import answer, conductor, deploy, ranking
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.rehearsal import Host, Workload, spectune_plan
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from spectune_sim.landscapes import LANDSCAPES, Landscape
from spectune_sim.model import check_memory

# The share within which the cheapest tied candidate is preferred (None: the spec's min_gain).
TIE_WITHIN: float | None = None
# The policy the studies run under (`--policy`), carried into each study's snapshots.
POLICY: Policy = DEFAULT_POLICY


@dataclass
class NoisyHost(Host):
    """A simulated host whose every launch also draws a launch-to-launch factor."""

    launch_sd: float = 0.01
    factor: float = 1.0

    def _start(self, config: SpecConfig | None) -> None:
        super()._start(config)
        self.factor = math.exp(self.rng.gauss(0.0, self.launch_sd))

    def _measure(self, config: SpecConfig | None) -> list[dict[str, Any]]:
        levels = super()._measure(config)
        for lv in levels:
            lv["output_tok_s"] *= self.factor
            lv["output_tok_s_runs"] = [r * self.factor for r in lv["output_tok_s_runs"]]
        return levels


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
    """One study as the service runs it (search_efficiency.drive: the conductor decides every
    step), then its answer as the service gives it (api.services.studies: the winner)."""
    wl = Workload(levels=tuple(spec.workload.concurrency))
    plan = spectune_plan(spec)
    hosts: list[Host] = [
        NoisyHost(ls, wl, plan, random.Random(f"{ls.name}/{seed}/{k}"), seed, host_id=f"h{k}", launch_sd=launch_sd)
        for k in range(2)
    ]
    store = drive(hosts, spec, POLICY)
    by_kind: dict[str, int] = {}
    for h in hosts:
        for k, v in h.launches.items():
            by_kind[k] = by_kind.get(k, 0) + v
    by_kind.pop("oom", None)
    launches = sum(by_kind.values())
    extra = sum(le.extra_passes for le in store.leases)
    snap = store.snapshot(datetime.fromtimestamp(max(h.clock_s for h in hosts), UTC), [h.host_id for h in hosts])
    noise = conductor.launch_noise(snap)
    docs = {d["trial_number"]: d for d in store.confirmations(snap) if (d["violation"] or 0.0) <= 0}
    if not docs:  # "does not pay", or nothing confirmed: the printed command runs without speculation
        base_started = _starts(ls, deploy.deployment_settings(spec, None)[0])
        return Outcome(False, 1.0, best, None, None, None, launches, by_kind, extra, base_started, "", None,
                       noise.sd)  # fmt: skip
    contenders = [answer.Contender.of_json(d) for d in docs.values()]
    rank = ranking.of(spec, snap.trials, snap.verify_shapes(), conductor.relaunched(snap), snap.policy)
    choice = answer.winner(spec, snap.trials, contenders, rank, TIE_WITHIN)
    assert choice is not None
    w = choice.winner
    iv = w.interval
    pays = answer.clears(w.speedup, iv)
    true = truth.value(w.config)
    covered = None if iv is None else iv.low <= true <= iv.high
    env = docs[w.trial_number]["envelope"]
    started = _starts(ls, env.settings) if pays else _starts(ls, deploy.deployment_settings(spec, None)[0])
    return Outcome(
        pays, true if pays else 1.0, best, covered, None if iv is None else (iv.low, iv.high), w.speedup,
        launches, by_kind, extra, started, env.note, choice.note, noise.sd,
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
    add_policy_flag(ap)
    args = ap.parse_args(argv)
    global TIE_WITHIN, POLICY
    TIE_WITHIN = args.tie_within
    POLICY = policy_of(ap, args)
    t0 = time.monotonic()
    for case in args.cases.split(","):
        outs = run(case, args.seeds or CASES[case][4], args.launch_sd)
        print("\n".join(report(case, outs)), flush=True)
    print(f"({time.monotonic() - t0:.0f} s; launch-to-launch sd {args.launch_sd})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
