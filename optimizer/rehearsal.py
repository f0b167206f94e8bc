"""A study rehearsed in memory: the service's own decision procedure on simulated hosts.

The conductor (optimizer.conductor) decides every step, as it does for the API, and its actions
are carried out by the service's own code (optimizer.actions) on the in-memory store
(optimizer.memory_store: Optuna's InMemoryStorage, the leases, the baselines).  What is left here
is the simulation: hosts on one clock (`Host`: the simulator's pure model, `spectune_sim.model`,
with its noise model) and the loop that lets each report when its host's clock comes.
benchmarks/search_efficiency.py measures the search with it on the simulator's landscapes;
`optimizer.estimate` rehearses a spec on engines drawn from the prior to say what a study will
cost before its first launch (`spectune study plan`).
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import optuna

from optimizer import actions, conductor
from optimizer import attrs as A
from optimizer.memory_store import MemoryStudy, SimLease
from optimizer.plan import server_settings
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig, max_draft_tokens
from optimizer.spec import StudySpec
from optimizer.store import ConfigState
from optimizer.study_state import StudyState
from optimizer.verify_probe import ProbePlan, probe_levels
from spectune_protocol import LevelMetrics, Resolve
from spectune_sim.landscapes import Landscape
from spectune_sim.model import NoiseModel, check_memory, extend_ms, predict, startup_seconds

__all__ = ["POLL_S", "Host", "MemoryStudy", "Plan", "Resolver", "SimLease", "Workload", "clock_at", "drive"]

# What a worker does with a confirmation's Resolve order (workers.resolve.resolve, passed in by
# the caller: the worker's own code, so the rehearsal's extra passes are the worker's):
# (order, levels measured, repeats, measure more passes) -> (merged levels, passes added, _).
MeasureMore = Callable[[list[int], int], list[LevelMetrics]]
Resolver = Callable[[Resolve, list[LevelMetrics], int, MeasureMore], tuple[list[LevelMetrics], int, Any]]

# A worker with nothing to do asks again after this long (the worker's poll interval).
POLL_S = 30.0


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
    # This launch's own speed (Landscape.launch_sigma; 1.0 when the landscape has no launch noise).
    launch_factor: float = 1.0
    # Every launch in order: (baseline | search | confirm, the configuration's key or None).
    history: list[tuple[str, str | None]] = field(default_factory=list)
    # The last baseline's verify probe, as a worker reports it (spectune_protocol.VerifyProbe).
    verify_probe: dict[str, Any] | None = None

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
        drift *= self.launch_factor
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

    def _probe(self) -> dict[str, Any]:
        """The worker's verify probe on this baseline server (workers/loadgen/probe.py's plan):
        each batch an extend forward of the simulator (`extend_ms`), with the host's noise; its
        time is spent on the clock, as the worker spends it inside the baseline's lease."""
        plan = ProbePlan(levels=probe_levels(self.workload.levels, self.plan.max_running_requests))
        drift = self.noise.drift_factor(self.seed, self.host_id, self.clock_s) * self.noise.host_factor(
            self.seed, self.host_id
        )
        # Its own draws: the host's stream (launch noise, passes) stays what it was without the probe.
        rng = random.Random(f"{self.seed}/{self.host_id}/probe/{self.clock_s!r}")
        points, spent = [], 0.0
        for b, k in plan.batches():
            ms = extend_ms(self.landscape, b * k, speculative=False) * drift * self.launch_factor
            runs = [ms / 1000.0 * self.noise.request_factor(rng) for _ in range(plan.repeats)]
            spent += sum(runs)
            points.append({"concurrency": b, "tokens": k, "seconds": statistics.median(runs), "seconds_runs": runs})
        self._spend(spent)
        return {"points": points, "prefix_tokens": plan.prefix_tokens, "cached_share": 1.0, "spent_s": spent}

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
        if self.landscape.launch_sigma > 0.0:  # no draw otherwise: the hand-written cases' noise as before
            self.launch_factor = math.exp(self.rng.gauss(0.0, self.landscape.launch_sigma))
        self._spend(self.last_startup_s + self.workload.warmup_s)

    def baseline_levels(self, *, fresh: bool = False) -> list[dict[str, Any]]:
        if fresh or self.clock_s - self.baseline_at > 6 * 3600:
            before = self.gpu_s
            self._start(None)
            self.baseline = self._measure(None)
            self.verify_probe = self._probe()
            self.baseline_at = self.clock_s
            self.count("baseline", before)
            self.history.append(("baseline", None))
        return self.baseline

    def launch(self, config: SpecConfig) -> tuple[str, list[dict[str, Any]]]:
        """('ok', levels) | ('oom', []) | ('invalid', []), counted under `self.kind` or failed."""
        before = self.gpu_s
        outcome, levels = self._launch(config)
        self.count(self.kind if outcome == "ok" else "failed", before)
        self.history.append((self.kind, config.key))
        if outcome == "oom":
            self.launches["oom"] = self.launches.get("oom", 0) + 1
        return outcome, levels

    def launch_with(self, settings: ServerSettings, config: SpecConfig) -> tuple[str, list[dict[str, Any]]]:
        """Launch `config` in a deployment's envelope (a confirmation proves the printed command)."""
        saved = self.plan
        self.plan = Plan(settings.max_running_requests, settings.cuda_graph_bs, settings.cuda_graph_max_bs)
        try:
            return self.launch(config)
        finally:
            self.plan = saved

    def more_passes(self, config: SpecConfig, levels: Sequence[int], passes: int) -> list[dict[str, Any]]:
        """More timed passes at `levels` on the running server (no start-up): a Resolve order."""
        saved = self.workload
        self.workload = dataclasses.replace(saved, levels=tuple(levels), repeats=passes)
        try:
            return self._measure(config)
        finally:
            self.workload = saved

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


def spectune_plan(spec: StudySpec) -> Plan:
    s = server_settings(spec, SpecConfig(num_steps=1, topk=1, num_draft_tokens=2))
    return Plan(s.max_running_requests, s.cuda_graph_bs, s.cuda_graph_max_bs)


# ----------------------------------------------------------------------------------------------
# The service's study, in memory: the conductor decides, optimizer.actions carries its actions
# out on the in-memory store; this loop is the simulation's (which host reports when).


def clock_at(clock_s: float) -> datetime:
    return datetime.fromtimestamp(clock_s, UTC)


def drive(hosts: list[Host], spec: StudySpec, resolver: Resolver, policy: Policy = DEFAULT_POLICY) -> MemoryStudy:
    """One study as the service runs it: the conductor (optimizer.conductor) decides every step.

    Workers (one per host) ask for work in the order of their hosts' clocks, and each result is
    reported when its host's clock is the earliest, so a worker asking meanwhile sees the other
    hosts' launches in flight.  After every result the conductor settles the study (the stop rule,
    the move to confirmation, the finish).  Each confirmation launches the deployment the conductor
    names (printed envelope first, the next one after an out-of-memory start) and adds the extra
    passes its Resolve order asks for on the warm server (`resolver`: the worker's).  Returns the
    store as the study ended.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # One clock for the fleet (each host's drift keeps its own phase): the conductor compares
    # times across hosts (a baseline measured after the confirmation began).
    start = min(h.clock_s for h in hosts)
    for h in hosts:
        h.clock_s = start
    # The simulated hosts model static servers only: no adaptive proof launch is queued.
    store = MemoryStudy(spec, clock_at(start), workers=[h.host_id for h in hosts], adaptive_proof=False, policy=policy)
    # host index -> (clock when done, what to record then)
    busy: dict[int, tuple[float, Callable[[datetime], None]]] = {}
    idle_polls = 0
    for _ in range(100 * spec.budget.max_trials):
        if store.state != StudyState.RUNNING:
            break
        idle = [i for i in range(len(hosts)) if i not in busy]
        if busy:
            i_next = min(busy, key=lambda i: busy[i][0])
            if not idle or min(hosts[i].clock_s for i in idle) >= busy[i_next][0]:
                done_at, record = busy.pop(i_next)
                now = clock_at(done_at)
                record(now)
                store.settle(now)
                continue
        i = min(idle, key=lambda j: hosts[j].clock_s)
        h = hosts[i]
        now = clock_at(h.clock_s)
        action = conductor.next_action(store.snapshot(now), h.host_id)
        if isinstance(action, conductor.StartConfirmation | conductor.Reconfirm | conductor.Finish):
            store.persist(action, now)
        elif isinstance(action, conductor.MeasureBaseline):
            busy[i] = _start_baseline(store, h, now, action.for_confirmation)
        elif isinstance(action, conductor.Ask):
            # None: every proposal was answered without a launch (the ask settled the study).
            if (asked := actions.ask(store, h.host_id, now)) is not None:
                busy[i] = _start_trial(store, h, asked[0].id, asked[1].number, asked[1].config)
        elif isinstance(action, conductor.Confirm):
            started = _start_confirm(store, h, now, store.lease(action.lease_id), action, resolver)
            if started is not None:
                busy[i] = started
        elif isinstance(action, conductor.Wait):
            # Polls again after the next result, or after a poll interval (another host may be the
            # one the study waits for).
            idle_polls = 0 if busy else idle_polls + 1
            if idle_polls > 4 * len(hosts):
                raise RuntimeError(f"the study waits with nothing in flight: {action.reason}")
            h.clock_s = min(b[0] for b in busy.values()) if busy else h.clock_s + POLL_S
            continue
        else:  # RetryLease: the simulated hosts never lose a lease
            raise RuntimeError(f"unexpected action {action!r}")
        idle_polls = 0
    else:
        raise RuntimeError("the study did not finish")
    return store


def _start_baseline(
    store: MemoryStudy, h: Host, now: datetime, for_confirmation: bool
) -> tuple[float, Callable[[datetime], None]]:
    lease = SimLease(f"b{len(store.leases)}", "baseline", "active", h.host_id, created_at=now, leased_at=now)
    store.leases.append(lease)
    h.kind = "confirm" if for_confirmation else "search"
    levels = h.baseline_levels(fresh=True)

    def record(at: datetime) -> None:
        store.end(lease.id, "completed", at)
        if h.verify_probe is not None:
            store.verify_probes[len(store.baselines)] = h.verify_probe
        store.add_baseline(h.host_id, at, levels)

    return h.clock_s, record


def _start_trial(
    store: MemoryStudy, h: Host, lease_id: str, number: int, config: SpecConfig
) -> tuple[float, Callable[[datetime], None]]:
    h.kind = "search"
    outcome, levels = h.launch(config)
    base = h.baseline

    def record(at: datetime) -> None:
        """api.services.leasing.trial.complete: the report told (optimizer.actions)."""
        attrs: dict[str, Any] = {
            A.WORKER_ID: h.host_id,
            A.CONFIG: config.model_dump(mode="json"),
            A.CONFIG_KEY: config.key,
            A.BASELINE_LEVELS: base,
        }
        study = store.study()
        state: ConfigState | None
        if outcome == "ok":
            tok_s = {int(b["concurrency"]): float(b["output_tok_s"]) for b in base}
            state, _ = actions.tell_measured(
                study, store.spec, number, levels, tok_s, attrs, {A.STARTUP_S: h.last_startup_s}
            )
        else:
            kind = "oom" if outcome == "oom" else "invalid_config"
            state = actions.tell_failure(study, number, kind, kind, attrs)
        if state is not None:
            store.set_config_state(config.key, state)
        store.end(lease_id, "completed" if outcome == "ok" else "failed", at)

    return h.clock_s, record


def _start_confirm(
    store: MemoryStudy, h: Host, now: datetime, lease: SimLease, action: conductor.Confirm, resolver: Resolver
) -> tuple[float, Callable[[datetime], None]] | None:
    """api.services.leasing.confirm: claim (optimizer.actions.claim_confirm), launch as deployed,
    the conductor's extra passes, complete (a failed start: optimizer.actions.confirm_failed)."""
    assert lease.config is not None
    if not actions.claim_confirm(store, lease.record(), action, now, store.trials()):
        return None  # every envelope left is known to run out of memory: out, without a launch
    assert lease.envelope is not None
    cfg, order = lease.config, action.resolve
    h.kind = "confirm"
    base = h.baseline
    outcome, levels = h.launch_with(lease.envelope.settings, cfg)
    if outcome == "ok" and order is not None:

        def measure(cs: list[int], k: int) -> list[LevelMetrics]:
            return [LevelMetrics.model_validate(lv) for lv in h.more_passes(cfg, cs, k)]

        merged, lease.extra_passes, _ = resolver(
            order, [LevelMetrics.model_validate(lv) for lv in levels], store.spec.workload.repeats, measure
        )
        levels = [m.model_dump(mode="json") for m in merged]

    def record(at: datetime) -> None:
        store.end(lease.id, "completed" if outcome == "ok" else "failed", at)
        if outcome == "ok":
            lease.measurement = (levels, base)
            finder = next(
                (t.user_attrs.get(A.WORKER_ID) for t in store.trials() if t.number == lease.trial_number), None
            )
            lease.independent = lease.trial_number is None or finder != h.host_id
            return
        kind = "oom" if outcome == "oom" else "invalid_config"
        if outcome == "oom":
            lease.failure = "oom"
        # One attempt: a simulated host is never at fault.
        actions.confirm_failed(
            store, lease.record(), at, kind, kind, host_fault=False, max_attempts=1, trials=store.trials()
        )

    return h.clock_s, record
