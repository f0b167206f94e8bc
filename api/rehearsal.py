"""A study rehearsed in memory: the service's own decision procedure on simulated hosts.

The conductor (optimizer.conductor) decides every step, as it does for the API; this module only
carries its actions out on an in-memory store (Optuna's InMemoryStorage, the leases, the
baselines) with simulated hosts on one clock (`Host`: the simulator's pure model,
`spectune_sim.model`, with its noise model).  benchmarks/search_efficiency.py measures the search
with it on the simulator's landscapes; `api.estimate` rehearses a spec on engines drawn from the
prior to say what a study will cost before its first launch.  Moved here from the benchmark so
both run the same loop.
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

from api.services.leasing.trial import MAX_DUPLICATE_PROPOSALS
from optimizer import attrs as A
from optimizer import conductor, confirmation, deploy
from optimizer import study as opt
from optimizer.infeasible import known_to_fail, oom_points
from optimizer.objective import CONSTRAINT_KEY, LevelResult, score
from optimizer.plan import server_settings
from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig, max_draft_tokens
from optimizer.spec import StudySpec
from optimizer.study_state import Ending, Phase, StudyState
from spectune_protocol import LeaseKind, LeaseState, LevelMetrics
from spectune_sim.landscapes import Landscape
from spectune_sim.model import NoiseModel, check_memory, predict, startup_seconds
from workers.resolve import resolve

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
# The service's study, in memory: the conductor decides, this loop only carries its actions out.


@dataclass
class SimLease:
    """A lease of the in-memory store (the service keeps these in spectune_leases)."""

    id: str
    kind: str  # baseline | trial | confirm
    state: str  # queued | active | completed | failed
    worker_id: str | None = None
    trial_number: int | None = None
    config: SpecConfig | None = None
    created_at: datetime | None = None
    leased_at: datetime | None = None
    finished_at: datetime | None = None
    avoid_worker: str | None = None
    measurement: tuple[list[Any], list[Any]] | None = None  # confirm: (levels, paired baseline levels)
    tier: int = 0  # confirm: the deployment envelope it launches (optimizer.conductor.next_deployment)
    envelope: deploy.Envelope | None = None
    extra_passes: int = 0  # confirm: passes added on the warm server (the conductor's Resolve order)
    failure: str | None = None  # confirm: "oom" when its deployment did not start
    # confirm: measured on another host than the one that found it (api.services.leasing.confirm
    # .not_independent; a simulated host is its own token, so the worker id decides).
    independent: bool = True

    def view(self) -> conductor.LeaseView:
        return conductor.LeaseView(
            id=self.id,
            kind=LeaseKind(self.kind),
            state=LeaseState(self.state),
            trial_number=self.trial_number,
            worker_id=self.worker_id,
            config_key=None if self.config is None else self.config.key,
            created_at=self.created_at,
            leased_at=self.leased_at,
            finished_at=self.finished_at,
            avoid_worker=self.avoid_worker,
            measurement=self.measurement,
            config=self.config if self.kind == "confirm" else None,
            tier=self.tier if self.kind == "confirm" else None,
            server=None if self.envelope is None else self.envelope.settings,
            failure=self.failure,
            independent=self.independent,
        )


@dataclass
class MemoryStudy:
    """What the service stores for one study (the study row, its leases, the hosts' baselines, the
    launched configurations), held in memory next to Optuna's InMemoryStorage."""

    spec: StudySpec
    created_at: datetime
    storage: optuna.storages.InMemoryStorage = field(default_factory=optuna.storages.InMemoryStorage)
    state: StudyState = StudyState.RUNNING
    phase: Phase = Phase.SEARCH
    ending: Ending | None = None
    confirmation_began_at: datetime | None = None
    launched: dict[str, int] = field(default_factory=dict)  # config key -> trial number
    config_state: dict[str, str] = field(default_factory=dict)  # pending | done | infeasible
    leases: list[SimLease] = field(default_factory=list)
    baselines: list[conductor.Baseline] = field(default_factory=list)

    def __post_init__(self) -> None:
        opt.create_study(self.storage, self.spec)

    def study(self) -> optuna.Study:
        return opt.load_study(self.storage, self.spec)

    def snapshot(self, now: datetime, workers: Sequence[str]) -> conductor.Snapshot:
        return conductor.Snapshot(
            spec=self.spec,
            state=self.state,
            phase=self.phase,
            created_at=self.created_at,
            now=now,
            trials=self.study().get_trials(deepcopy=False),
            launched=frozenset(self.launched),
            leases=[le.view() for le in self.leases if le.kind == "confirm" or le.state in ("queued", "active")],
            baselines=sorted(self.baselines, key=lambda b: b.measured_at),
            hosts=[conductor.HostView(w, now) for w in workers],
            confirmation_began_at=self.confirmation_began_at,
            ending=self.ending,
            search_done=self.search_done(),
        )

    def search_done(self) -> dict[str, datetime]:
        """Per host, when its latest search launch ended (api.services.study_life.snapshot's query)."""
        done: dict[str, datetime] = {}
        for le in self.leases:
            if le.kind == "trial" and le.worker_id is not None and le.finished_at is not None:
                done[le.worker_id] = max(le.finished_at, done.get(le.worker_id, le.finished_at))
        return done

    def persist(self, action: conductor.Action, now: datetime) -> None:
        """What api.services.study_life.persist does with a study-level action."""
        if isinstance(action, conductor.StartConfirmation | conductor.Reconfirm):
            if isinstance(action, conductor.StartConfirmation):
                self.phase, self.ending, self.confirmation_began_at = Phase.CONFIRMATION, action.ending, now
            for c in action.candidates:
                if c.adaptive:
                    continue  # the simulated hosts model static servers only: no adaptive proof launch
                self.leases.append(
                    SimLease(
                        f"c{len(self.leases)}",
                        "confirm",
                        "queued",
                        trial_number=c.trial_number,
                        config=c.config,
                        created_at=now,
                        avoid_worker=c.avoid_worker,
                        tier=c.tier,
                        envelope=c.envelope,
                    )
                )
        elif isinstance(action, conductor.Finish):
            self.state, self.ending = StudyState.FINISHED, action.ending

    def confirmations(self, snap: conductor.Snapshot) -> list[dict[str, Any]]:
        """The completed confirmations as api.services.studies documents them: each against its
        paired baseline, with the study's launch noise as it stands (`snap`'s)."""
        extra_var = conductor.launch_noise(snap).variance
        searched = {t.number: t.value for t in snap.trials}
        # A configuration confirmed more than once (conductor.relaunches) is one entry: its
        # confirmation launches pooled, the latest one's envelope and host.
        by_trial: dict[int | None, list[SimLease]] = {}
        for le in self.leases:
            if le.kind == "confirm" and le.state == "completed" and le.measurement is not None and le.config:
                by_trial.setdefault(le.trial_number, []).append(le)
        out = []
        for number, les in by_trial.items():
            le = les[-1]
            assert le.config is not None
            got = confirmation.pooled_result(self.spec, [m for x in les if (m := x.measurement)], extra_var)
            out.append(
                got.as_json()
                | {"config": le.config.model_dump(mode="json"), "trial_number": number}
                | {"search_speedup": searched.get(number or -1)}
                | {"worker_id": le.worker_id, "envelope": le.envelope}
                | {"extra_passes": sum(x.extra_passes for x in les)}
            )
        return out

    def deploy_failures(self) -> list[tuple[SpecConfig, int]]:
        """(configuration, envelope tier) of confirmations that ran out of memory at start-up."""
        return [(le.config, le.tier) for le in self.leases if le.failure == "oom" and le.config is not None]

    def lease(self, lease_id: str) -> SimLease:
        return next(le for le in self.leases if le.id == lease_id)


def clock_at(clock_s: float) -> datetime:
    return datetime.fromtimestamp(clock_s, UTC)


def _ask(store: MemoryStudy) -> tuple[int, SpecConfig] | None:
    """api.services.leasing.trial.ask_new without the database: a configuration launched before is
    answered from its earlier trial (its value and its violation), one known to run out of memory
    is told infeasible without a launch; None when every proposal was one of those."""
    for _ in range(MAX_DUPLICATE_PROPOSALS):
        study = store.study()
        asked = opt.ask(study, store.spec)
        key = asked.config.key
        proof = known_to_fail(asked.config, oom_points(study.get_trials(deepcopy=False)))
        if proof is not None:
            opt.tell_infeasible(
                study,
                asked.number,
                {A.INFERRED_FROM: proof.trial_number, A.FAILURE_KIND: "oom", A.FAILURE_MESSAGE: "not launched"},
            )
            continue
        if key not in store.launched:
            store.launched[key] = asked.number
            store.config_state[key] = "pending"
            return asked.number, asked.config
        prior = opt.get_trial(study, store.launched[key])
        attrs: dict[str, Any] = {A.DUPLICATE_OF: prior.number}
        if store.config_state[key] == "done" and prior.value is not None:
            violation = prior.constraints.get(CONSTRAINT_KEY, 0.0)
            opt.tell_value(study, asked.number, prior.value, violation, {**prior.user_attrs, **attrs})
        elif store.config_state[key] == "infeasible":
            opt.tell_infeasible(study, asked.number, attrs)
        else:
            opt.tell_failed(study, asked.number, {**attrs, A.FAILURE_KIND: "duplicate"})
    return None


def _tell_result(
    store: MemoryStudy, host: Host, number: int, config: SpecConfig, outcome: str, levels: list[Any]
) -> None:
    """api.services.leasing.trial.complete / _tell without the database."""
    spec, study = store.spec, store.study()
    attrs: dict[str, Any] = {
        A.WORKER_ID: host.host_id,
        A.CONFIG: config.model_dump(mode="json"),
        A.CONFIG_KEY: config.key,
        A.BASELINE_LEVELS: host.baseline,
    }
    if outcome != "ok":
        kind = "oom" if outcome == "oom" else "invalid_config"
        opt.tell_infeasible(study, number, attrs | {A.FAILURE_KIND: kind, A.FAILURE_MESSAGE: kind})
        store.config_state[config.key] = "infeasible"
        return
    base = {int(b["concurrency"]): float(b["output_tok_s"]) for b in host.baseline}
    results = [LevelResult(int(lv["concurrency"]), float(lv["output_tok_s"])) for lv in levels]
    sc = score(spec.objective, results, base)
    attrs |= {
        A.BASELINE_TOK_S: {str(k): v for k, v in base.items()},
        A.LEVELS: levels,
        A.STARTUP_S: host.last_startup_s,
        A.SPEEDUP_BY_LEVEL: {str(k): v for k, v in sc.speedups.items()},
    }
    opt.tell_value(study, number, sc.value, sc.violation, attrs)
    store.config_state[config.key] = "done"


def drive(hosts: list[Host], spec: StudySpec) -> MemoryStudy:
    """One study as the service runs it: the conductor (optimizer.conductor) decides every step.

    Workers (one per host) ask for work in the order of their hosts' clocks, and each result is
    reported when its host's clock is the earliest, so a worker asking meanwhile sees the other
    hosts' launches in flight.  After every result the conductor settles the study (the stop rule,
    the move to confirmation, the finish).  Each confirmation launches the deployment the conductor
    names (printed envelope first, the next one after an out-of-memory start) and adds the extra
    passes its Resolve order asks for on the warm server.  Returns the store as the study ended.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # One clock for the fleet (each host's drift keeps its own phase): the conductor compares
    # times across hosts (a baseline measured after the confirmation began).
    start = min(h.clock_s for h in hosts)
    for h in hosts:
        h.clock_s = start
    store = MemoryStudy(spec, clock_at(start))
    workers = [h.host_id for h in hosts]
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
                store.persist(conductor.settle(store.snapshot(now, workers)), now)
                continue
        i = min(idle, key=lambda j: hosts[j].clock_s)
        h = hosts[i]
        now = clock_at(h.clock_s)
        action = conductor.next_action(store.snapshot(now, workers), h.host_id)
        if isinstance(action, conductor.StartConfirmation | conductor.Reconfirm | conductor.Finish):
            store.persist(action, now)
        elif isinstance(action, conductor.MeasureBaseline):
            busy[i] = _start_baseline(store, h, now, action.for_confirmation)
        elif isinstance(action, conductor.Ask):
            asked = _ask(store)
            if asked is None:
                store.persist(conductor.settle(store.snapshot(now, workers)), now)
            else:
                busy[i] = _start_trial(store, h, now, *asked)
        elif isinstance(action, conductor.Confirm):
            started = _start_confirm(store, h, now, store.lease(action.lease_id), action)
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
        lease.state, lease.finished_at = "completed", at
        tok_s = {int(b["concurrency"]): float(b["output_tok_s"]) for b in levels}
        store.baselines.append(conductor.Baseline(len(store.baselines), h.host_id, at, tok_s, levels=levels))

    return h.clock_s, record


def _start_trial(
    store: MemoryStudy, h: Host, now: datetime, number: int, config: SpecConfig
) -> tuple[float, Callable[[datetime], None]]:
    lease = SimLease(f"t{len(store.leases)}", "trial", "active", h.host_id, number, config, now, now)
    store.leases.append(lease)
    h.kind = "search"
    outcome, levels = h.launch(config)

    def record(at: datetime) -> None:
        _tell_result(store, h, number, config, outcome, levels)
        lease.state, lease.finished_at = ("completed" if outcome == "ok" else "failed"), at

    return h.clock_s, record


def _start_confirm(
    store: MemoryStudy, h: Host, now: datetime, lease: SimLease, action: conductor.Confirm
) -> tuple[float, Callable[[datetime], None]] | None:
    """api.services.leasing.confirm: claim (the deployment the conductor names, or what the study's
    failures leave), launch as deployed, the conductor's extra passes, complete (a failed start:
    the next envelope)."""
    assert lease.config is not None
    cfg, order = lease.config, action.resolve
    due = action.deployment or conductor.next_deployment(
        store.spec, cfg, store.deploy_failures(), lease.tier - 1, store.study().get_trials(deepcopy=False)
    )
    if due is None:  # every envelope left is known to run out of memory: out, without a launch
        lease.state, lease.finished_at = "failed", now
        return None
    lease.tier, lease.envelope = due
    lease.state, lease.worker_id, lease.leased_at = "active", h.host_id, now
    h.kind = "confirm"
    base = h.baseline
    outcome, levels = h.launch_with(due[1].settings, cfg)
    if outcome == "ok" and order is not None:

        def measure(cs: list[int], k: int) -> list[LevelMetrics]:
            return [LevelMetrics.model_validate(lv) for lv in h.more_passes(cfg, cs, k)]

        merged, lease.extra_passes, _ = resolve(
            order, [LevelMetrics.model_validate(lv) for lv in levels], store.spec.workload.repeats, measure
        )
        levels = [m.model_dump(mode="json") for m in merged]

    def record(at: datetime) -> None:
        lease.finished_at = at
        lease.state = "completed" if outcome == "ok" else "failed"
        if outcome == "ok":
            lease.measurement = (levels, base)
            finder = next(
                (
                    t.user_attrs.get(A.WORKER_ID)
                    for t in store.study().get_trials(deepcopy=False)
                    if t.number == lease.trial_number
                ),
                None,
            )
            lease.independent = lease.trial_number is None or finder != h.host_id
        elif outcome == "oom":
            lease.failure = "oom"
            after = conductor.next_deployment(
                store.spec, cfg, store.deploy_failures(), lease.tier, store.study().get_trials(deepcopy=False)
            )
            if after is not None:  # the same configuration in the next smaller graph envelope
                store.leases.append(
                    dataclasses.replace(
                        lease, id=f"c{len(store.leases)}", state="queued", worker_id=None, created_at=at,
                        leased_at=None, finished_at=None, failure=None, tier=after[0], envelope=after[1],
                    )
                )  # fmt: skip

    return h.clock_s, record
