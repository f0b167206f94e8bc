"""A study held in memory: the `StudyStore` (optimizer/store.py) next to Optuna's InMemoryStorage.

What the service keeps in its database for one study (the study row, its leases, the hosts'
baselines, the launched configurations, the events), kept in lists and dicts.  The rehearsal
(optimizer/rehearsal.py) runs the conductor's actions (optimizer/actions.py) on it; the service
runs the same actions on its own store (api/services/leasing/sql_store.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from optimizer import actions, conductor, confirmation, deploy
from optimizer import study as opt
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from optimizer.store import ConfigState, ConfirmInfo, Deployment, LeaseRecord, PriorLaunch, QueuedConfirm
from optimizer.study_state import Ending, Phase, StudyState
from optimizer.verify_probe import latest_shapes
from spectune_protocol import LeaseKind, LeaseState


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
    tier: int | None = 0  # confirm: the deployment envelope it launches (None: the adaptive proof)
    envelope: deploy.Envelope | None = None
    extra_passes: int = 0  # confirm: passes added on the warm server (the conductor's Resolve order)
    failure: str | None = None  # confirm: "oom" when its deployment did not start
    # confirm: measured on another host than the one that found it (api.services.leasing.confirm
    # .not_independent; a simulated host is its own token, so the worker id decides).
    independent: bool = True
    attempt: int = 1
    info: ConfirmInfo | None = None  # confirm: what it carries besides its configuration
    # Its launch-noise group where that is not its configuration's key (the adaptive proof's).
    key: str | None = None

    @property
    def config_key(self) -> str | None:
        return self.key or (None if self.config is None else self.config.key)

    def view(self) -> conductor.LeaseView:
        return conductor.LeaseView(
            id=self.id,
            kind=LeaseKind(self.kind),
            state=LeaseState(self.state),
            trial_number=self.trial_number,
            worker_id=self.worker_id,
            config_key=self.config_key,
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

    def record(self) -> LeaseRecord:
        return LeaseRecord(
            id=self.id,
            kind=self.kind,
            trial_number=self.trial_number,
            config=self.config,
            config_key=self.config_key,
            attempt=self.attempt,
            worker_id=self.worker_id,
            tier=self.tier if self.kind == "confirm" else None,
            server=None if self.envelope is None else self.envelope.settings,
            confirm=self.info,
        )


@dataclass
class MemoryStudy:
    """What the service stores for one study, held in memory next to Optuna's InMemoryStorage."""

    spec: StudySpec
    created_at: datetime
    storage: optuna.storages.InMemoryStorage = field(default_factory=optuna.storages.InMemoryStorage)
    state: StudyState = StudyState.RUNNING
    phase: Phase = Phase.SEARCH
    ending: Ending | None = None
    confirmation_began_at: datetime | None = None
    launched: dict[str, int] = field(default_factory=dict)  # config key -> trial number
    config_state: dict[str, ConfigState] = field(default_factory=dict)
    leases: list[SimLease] = field(default_factory=list)
    baselines: list[conductor.Baseline] = field(default_factory=list)
    # Each baseline's verify probe by its id (the service stores it in the baseline's metrics).
    verify_probes: dict[int, dict[str, Any]] = field(default_factory=dict)
    # The decision values in force (optimizer.policy), carried in every snapshot.
    policy: Policy = DEFAULT_POLICY
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, lease id, detail)
    workers: Sequence[str] = ()  # the hosts (the service knows its registered workers)
    # False: the hosts launch static servers only, and no adaptive proof is queued (the rehearsal's).
    adaptive_proof: bool = True

    def __post_init__(self) -> None:
        opt.create_study(self.storage, self.spec)

    # ------------------------------------------------------------------ reading

    def study(self) -> optuna.Study:
        # The sampler fits with the probed verify cost, as the snapshot's stop rule and ranking do
        # (api.services.study_specs.load_study, the service's).
        return opt.load_study(
            self.storage, self.spec, policy=self.policy, shapes=latest_shapes(self.probed_baselines())
        )

    def probed_baselines(self) -> list[conductor.Baseline]:
        """The baselines, oldest first, each with its verify probe (kept by id in `verify_probes`)."""
        return [
            dataclasses.replace(b, verify_probe=self.verify_probes.get(b.id))
            for b in sorted(self.baselines, key=lambda b: b.measured_at)
        ]

    def trials(self) -> list[FrozenTrial]:
        return self.study().get_trials(deepcopy=False)

    def snapshot(self, now: datetime, workers: Sequence[str] = ()) -> conductor.Snapshot:
        return conductor.Snapshot(
            spec=self.spec,
            state=self.state,
            phase=self.phase,
            created_at=self.created_at,
            now=now,
            trials=self.trials(),
            launched=frozenset(self.launched),
            leases=[le.view() for le in self.leases if le.kind == "confirm" or le.state in ("queued", "active")],
            baselines=self.probed_baselines(),
            hosts=[conductor.HostView(w, now) for w in (workers or self.workers)],
            confirmation_began_at=self.confirmation_began_at,
            ending=self.ending,
            search_done=self.search_done(),
            policy=self.policy,
        )

    def search_done(self) -> dict[str, datetime]:
        """Per host, when its latest search launch ended (api.services.study_life.snapshot's query)."""
        done: dict[str, datetime] = {}
        for le in self.leases:
            if le.kind == "trial" and le.worker_id is not None and le.finished_at is not None:
                done[le.worker_id] = max(le.finished_at, done.get(le.worker_id, le.finished_at))
        return done

    def lease(self, lease_id: str) -> SimLease:
        return next(le for le in self.leases if le.id == lease_id)

    def deploy_failures(self) -> list[tuple[SpecConfig, int]]:
        return conductor.deploy_failures(le.view() for le in self.leases)

    def levels_measured(self, trial_number: int) -> list[dict[str, Any]]:
        return []  # the simulated hosts never stop a launch part-way

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

    # ------------------------------------------------------------------ the study's life

    def persist(self, action: conductor.Action, now: datetime) -> None:
        """What api.services.study_life.persist does with a study-level action."""
        if isinstance(action, conductor.StartConfirmation | conductor.Reconfirm):
            if isinstance(action, conductor.StartConfirmation):
                self.phase, self.ending, self.confirmation_began_at = Phase.CONFIRMATION, action.ending, now
            actions.queue_confirmations(self, action.candidates, now, adaptive_proof=self.adaptive_proof)
        elif isinstance(action, conductor.Finish):
            self.state, self.ending = StudyState.FINISHED, action.ending

    def settle(self, now: datetime) -> None:
        self.persist(conductor.settle(self.snapshot(now)), now)

    # ------------------------------------------------------------------ trials

    def record_trial(self, asked: opt.AskedTrial, worker_id: str, now: datetime) -> LeaseRecord | PriorLaunch:
        key = asked.config.key
        if key in self.launched:
            return PriorLaunch(self.launched[key], self.config_state[key])
        self.launched[key] = asked.number
        self.config_state[key] = ConfigState.PENDING
        lease = SimLease(f"t{len(self.leases)}", "trial", "active", worker_id, asked.number, asked.config, now, now)
        self.leases.append(lease)
        return lease.record()

    def set_config_state(self, config_key: str | None, state: ConfigState) -> None:
        if config_key is not None:
            self.config_state[config_key] = state

    def queue_retry(self, lease: LeaseRecord, now: datetime) -> None:
        old = self.lease(lease.id)
        self.leases.append(
            dataclasses.replace(
                old, id=f"t{len(self.leases)}", state="queued", worker_id=None, created_at=now, leased_at=None,
                finished_at=None, attempt=old.attempt + 1,
            )
        )  # fmt: skip

    def queue_confirm(self, confirm: QueuedConfirm, now: datetime) -> None:
        info = confirm.info
        self.leases.append(
            SimLease(
                f"c{len(self.leases)}", "confirm", "queued", trial_number=confirm.trial_number, config=confirm.config,
                created_at=now, avoid_worker=info.avoid_worker, tier=info.tier, envelope=confirm.envelope, info=info,
                key=confirm.config_key,
            )
        )  # fmt: skip

    def end(self, lease_id: str, state: str, now: datetime) -> None:
        le = self.lease(lease_id)
        le.state, le.finished_at = state, now

    # ------------------------------------------------------------------ baselines

    def add_baseline(self, worker_id: str, at: datetime, levels: Sequence[Mapping[str, Any]]) -> None:
        tok_s = {int(b["concurrency"]): float(b["output_tok_s"]) for b in levels}
        self.baselines.append(conductor.Baseline(len(self.baselines), worker_id, at, tok_s, levels=list(levels)))

    # ------------------------------------------------------------------ confirmations

    def claim_confirm(
        self, lease: LeaseRecord, action: conductor.Confirm, now: datetime, due: Deployment | None
    ) -> None:
        le = self.lease(lease.id)
        if due is not None:
            le.tier, le.envelope = due
            if le.info is not None:
                le.info = dataclasses.replace(le.info, tier=due[0], envelope_note=due[1].note)
        le.state, le.worker_id, le.leased_at = "active", action.worker_id, now

    def end_lease(self, lease: LeaseRecord, state: str, now: datetime) -> None:
        self.end(lease.id, state, now)

    def requeue_confirm(
        self, lease: LeaseRecord, now: datetime, info: ConfirmInfo, server: ServerSettings | None
    ) -> None:
        old = self.lease(lease.id)
        envelope = old.envelope if server is None else deploy.Envelope(server, info.envelope_note)
        self.leases.append(
            dataclasses.replace(
                old, id=f"c{len(self.leases)}", state="queued", worker_id=None, created_at=now, leased_at=None,
                finished_at=None, failure=None, tier=info.tier, envelope=envelope, info=info,
                attempt=old.attempt + 1, measurement=None, extra_passes=0,
            )
        )  # fmt: skip

    def event(self, kind: str, lease: LeaseRecord, detail: str) -> None:
        self.events.append((kind, lease.id, detail))
