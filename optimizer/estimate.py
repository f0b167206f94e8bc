"""What a study will likely cost before its first launch: launches, GPU-hours and wall time.

Not a formula: the study's own decision procedure (the conductor, as `optimizer.rehearsal.drive`
runs it for benchmarks/search_efficiency.py) is rehearsed on engines drawn from the prior's plausible
range for this spec, and the spread of what it spent gives the range.

* The engines: a simulator landscape of the spec's tensor-parallel size (its model class,
  interconnect, memory and start-up: `spectune_sim.landscapes`), with its acceptance and costs
  drawn from the `auto` sampler's own priors (`optimizer.perf_model`, the published ranges of
  docs/calibration.md §4-6): acceptance by draft position, tree gain, draft-step cost, the
  verify cost's slopes and knee, and the per-cycle overhead.
* The study: the spec as given (its warm starts enqueued first, its budget, stop rule and
  confirmation), at `workers` hosts, each host's launch start-up from the simulator's model of
  graph capture (what `optimizer.launch_cost` is fitted to once the study runs).
* The range: the 10th and 90th percentiles of the rehearsals (80%), and their median.

Every call draws afresh from its seed; nothing is cached between calls.  The service's document
of it is `api.documents.Estimate` (api/estimate.py); benchmarks/plan_calibration.py reads this one.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import warnings
from collections.abc import Sequence

import optuna

from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.rehearsal import Host, Resolver, Workload, drive, spectune_plan
from optimizer.spec import StudySpec
from spectune_sim.landscapes import LANDSCAPES, Landscape
from spectune_sim.model import NoiseModel

# Rehearsals per estimate: each is a whole study (about 2-4 s of one core), and 12 put the 10th
# and 90th percentiles between the 1st-2nd and 11th-12th of them.
DEFAULT_DRAWS = 12
# Per-host speedup offset a host's own baseline does not cancel: the benchmark's assumption
# (benchmarks/search_efficiency.py SPEC_HOST_SD).
SPEC_HOST_SD = 0.005
# A host's warm-up before each benchmark, seconds (the benchmark's Workload default).
WARMUP_S = 10.0
# Draft positions drawn: the space's deepest (optimizer.space: steps up to 10).
POSITIONS = 10


@dataclasses.dataclass(frozen=True)
class Spread:
    """The median of the rehearsals and the 80% range (10th to 90th percentile)."""

    expected: float
    low: float
    high: float

    def covers(self, value: float) -> bool:
        return self.low <= value <= self.high


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What the study will likely spend, before any GPU is used (api.documents.Estimate documents it)."""

    workers: int  # hosts the study was rehearsed at
    draws: int  # rehearsals: engines drawn from the prior, each a whole study
    launches: Spread
    gpu_hours: Spread
    wall_hours: Spread
    engines: str  # what the engines were drawn from, in words


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    """One rehearsed study: what it spent."""

    launches: int
    gpu_hours: float
    wall_hours: float


def templates(spec: StudySpec) -> list[Landscape]:
    """The simulator's engines of the spec's class: its tensor-parallel size (the nearest one the
    simulator has), the calibrated ones only (not the benchmark's stress shapes)."""
    calibrated = [ls for ls in LANDSCAPES.values() if ls.noise_scale == 1.0 and not ls.verify_tile]
    tp = spec.model.tp_size
    nearest = min(abs(math.log(ls.tp_size / tp)) for ls in calibrated)
    return [ls for ls in calibrated if abs(math.log(ls.tp_size / tp)) == nearest]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def draw_engine(spec: StudySpec, rng: random.Random, policy: Policy = DEFAULT_POLICY) -> Landscape:
    """An engine for this spec: a template of its class with acceptance and costs drawn from the
    perf model's priors (`policy`'s, optimizer.perf_model; the plan runs before any study, so the
    default policy's), clipped to what a server can be (a draft step cheaper than a target decode,
    acceptance below 0.97)."""
    base = rng.choice(templates(spec))
    logit = rng.gauss(*policy.accept_first)
    accept = []
    for _ in range(POSITIONS):
        accept.append(_clip(_sigmoid(logit), 0.05, 0.97))
        logit += rng.gauss(0.0, policy.accept_step_sd)
    knee = rng.choice(policy.knees)
    return dataclasses.replace(
        base,
        name=f"{base.name}~prior",
        accept_by_depth=tuple(accept),
        tree_gain=_clip(rng.gauss(*policy.tree_gain), 0.0, 0.6),
        draft_step_frac=_clip(rng.gauss(*policy.delta), 0.02, 0.6),
        draft_topk_slope=_clip(rng.gauss(*policy.gamma), 0.0, 0.3),
        verify_slope=_clip(rng.gauss(*policy.beta), 0.005, 1.0),
        verify_knee=max(knee, 1),
        verify_slope_after=_clip(rng.gauss(*policy.beta_after), 0.0, 0.5),
        overhead_ms=base.decode_ms * _clip(rng.gauss(*policy.omega), 0.0, 1.0),
    )


def rehearse(spec: StudySpec, engine: Landscape, workers: int, seed: int, resolver: Resolver) -> Rehearsal:
    """The study on `workers` hosts of `engine`, as the service would run it (`resolver`: what the
    worker does with a confirmation's Resolve order, workers.resolve.resolve)."""
    wl = spec.workload
    workload = Workload(tuple(wl.concurrency), wl.num_prompts, wl.output_len, wl.repeats, WARMUP_S)
    plan = spectune_plan(spec)
    noise = NoiseModel(spec_host_sigma=SPEC_HOST_SD)
    hosts = [
        Host(engine, workload, plan, random.Random(f"{engine.name}/{seed}/{k}"), seed, noise=noise, host_id=f"h{k}")
        for k in range(workers)
    ]
    with warnings.catch_warnings():
        # Optuna's "experimental" notice on every study created: not the user's concern here.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        store = drive(hosts, spec.model_copy(update={"seed": seed}), resolver)
    launches = sum(n for h in hosts for kind, n in h.launches.items() if kind != "oom")
    gpu_h = sum(h.gpu_s for h in hosts) / 3600
    wall_h = (max(h.clock_s for h in hosts) - store.created_at.timestamp()) / 3600
    return Rehearsal(launches, gpu_h, wall_h)


def spread(values: Sequence[float]) -> Spread:
    """Median and the 10th-90th percentile range (inclusive method: within the values seen)."""
    if len(values) == 1:
        return Spread(values[0], values[0], values[0])
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return Spread(statistics.median(values), deciles[0], deciles[-1])


def estimate(
    spec: StudySpec, workers: int, resolver: Resolver, *, draws: int = DEFAULT_DRAWS, seed: int = 0
) -> Estimate:
    """Rehearse the study `draws` times, each on its own engine drawn from the prior."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if draws < 1:
        raise ValueError(f"draws must be at least 1, got {draws}")
    rng = random.Random(f"estimate/{spec.name}/{seed}")
    runs = [rehearse(spec, draw_engine(spec, rng), workers, seed * 1000 + i, resolver) for i in range(draws)]
    names = ", ".join(sorted(ls.name for ls in templates(spec)))
    return Estimate(
        workers=workers,
        draws=draws,
        launches=spread([r.launches for r in runs]),
        gpu_hours=spread([r.gpu_hours for r in runs]),
        wall_hours=spread([r.wall_hours for r in runs]),
        engines=f"tp {spec.model.tp_size}: {names}",
    )
