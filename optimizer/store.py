"""What a study is stored as, behind one protocol: the operations the conductor's actions need.

Optuna's `BaseStorage` / `InMemoryStorage` is the model: the conductor (optimizer.conductor) decides
on a `Snapshot`, and carrying an action out (optimizer.actions: ask with de-duplication, tell a
result, retry or give up, the next deployment envelope, a confirmation's deployment) is written
once over `StudyStore`.  Two stores implement it: the service's, on its database
(api/services/leasing/sql_store.py), and one in memory (optimizer/memory_store.py) that the
rehearsal (optimizer/rehearsal.py: benchmarks, `spectune study plan`) runs on.  The records the
actions read and write are typed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

import optuna
from optuna.trial import FrozenTrial

from optimizer.deploy import Envelope
from optimizer.policy import Policy
from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec

if TYPE_CHECKING:  # types only: the conductor imports nothing from here
    from optimizer import conductor
    from optimizer.study import AskedTrial

# Failures that belong to the configuration, not the host: the configuration is infeasible
# (told so, never retried) unless the worker says its host was at fault.
CONFIG_FAILURES = frozenset({"invalid_config", "oom", "launch_timeout"})

# Events the actions record about a confirmation's deployment.
DEPLOY_RETRY = "deploy_retry"
DEPLOY_FAILED = "deploy_failed"

# A confirmation's deployment: its tier and the envelope it launches (optimizer.conductor.next_deployment).
Deployment = tuple[int, Envelope]


class ConfigState(StrEnum):
    """What became of a configuration launched in a study (spectune_trial_configs.state)."""

    PENDING = "pending"  # leased or queued
    DONE = "done"
    INFEASIBLE = "infeasible"  # failed for the configuration's sake (OOM, invalid, launch time-out)
    PRUNED = "pruned"
    FAILED = "failed"  # infrastructure, after its retries


@dataclass(frozen=True)
class PriorLaunch:
    """A configuration the study launched before: the trial that launched it and where it stands."""

    trial_number: int
    state: ConfigState
    # An admin quarantined that trial: its measurement is not copied to a duplicate.
    quarantined: bool = False


@dataclass(frozen=True)
class LeaseRecord:
    """A trial or confirmation lease as the actions carry it out (what the conductor reads of a
    lease is `conductor.LeaseView`, built by the store's `snapshot`)."""

    id: str
    kind: str  # baseline | trial | confirm
    trial_number: int | None = None
    config: SpecConfig | None = None
    config_key: str | None = None
    attempt: int = 1
    worker_id: str | None = None
    # Confirm leases: the deployment tier it launches (None for the adaptive proof, which has no
    # tier), the server it launches, and the confirmation's own record.
    tier: int | None = None
    server: ServerSettings | None = None
    confirm: ConfirmInfo | None = None


@dataclass(frozen=True)
class ConfirmInfo:
    """What a queued confirmation carries besides its configuration (the lease's `confirm`)."""

    tier: int | None = None  # None: the adaptive proof
    envelope_note: str = ""
    avoid_worker: str | None = None
    search_speedup: float | None = None
    adaptive: bool = False
    # The pairing the conductor chose when it was handed out; an attempt queued again is paired anew.
    baseline_id: int | None = None
    baseline_fresh: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # keys this record does not know, kept as stored

    @classmethod
    def from_json(cls, info: dict[str, Any]) -> ConfirmInfo:
        known = {"tier", "envelope_note", "avoid_worker", "search_speedup", "adaptive", "baseline_id", "baseline_fresh"}
        adaptive = bool(info.get("adaptive"))
        return cls(
            tier=None if adaptive or info.get("tier") is None else int(info["tier"]),
            envelope_note=str(info.get("envelope_note") or ""),
            avoid_worker=info.get("avoid_worker"),
            search_speedup=info.get("search_speedup"),
            adaptive=adaptive,
            baseline_id=info.get("baseline_id"),
            baseline_fresh=bool(info.get("baseline_fresh")),
            extra={k: v for k, v in info.items() if k not in known},
        )

    def as_json(self) -> dict[str, Any]:
        """As the service stores it in the lease's payload (`confirm`): the adaptive proof has no tier."""
        out = dict(self.extra)
        out |= {"avoid_worker": self.avoid_worker, "search_speedup": self.search_speedup}
        out |= {"adaptive": True} if self.adaptive else {"tier": self.tier}
        out["envelope_note"] = self.envelope_note
        if self.baseline_id is not None:
            out |= {"baseline_id": self.baseline_id, "baseline_fresh": self.baseline_fresh}
        return out

    def unpaired(self) -> ConfirmInfo:
        """Without its baseline pairing: the next attempt is paired again."""
        return ConfirmInfo(
            self.tier, self.envelope_note, self.avoid_worker, self.search_speedup, self.adaptive, extra=self.extra
        )


@dataclass(frozen=True)
class GiveUp:
    """A trial out of attempts, to be told FAIL (the service tells it once its transaction is closed)."""

    spec: StudySpec
    number: int
    attrs: dict[str, Any]


class NotRecorded(Exception):
    """The asked trial could not get a lease; `reason` says why (the ask tells it FAIL).
    `worker_busy`: the worker got another lease concurrently."""

    def __init__(self, reason: str, *, worker_busy: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.worker_busy = worker_busy


@dataclass(frozen=True)
class QueuedConfirm:
    """A confirmation to queue, as optimizer.actions.queue_confirmations decides it: `config`
    launched in `envelope`'s server, `info` carried with it, grouped under `config_key` (the
    launch-noise groups: the adaptive proof has its own)."""

    trial_number: int | None
    config: SpecConfig
    config_key: str
    info: ConfirmInfo
    envelope: Envelope


class ConfirmQueue(Protocol):
    """Where queued confirmations are written (optimizer.actions.queue_confirmations): a study
    store, or the service's study-level write step (api/services/study_life.py), which holds the
    study's row lock in a session of its own."""

    @property
    def spec(self) -> StudySpec: ...

    def queue_confirm(self, confirm: QueuedConfirm, now: datetime) -> None:
        """A confirmation's first attempt, queued for any host."""
        ...


class StudyStore(ConfirmQueue, Protocol):
    """One study's records: Optuna's trials, the launched configurations, the leases, the
    baselines and the events, as the conductor's actions read and write them."""

    @property
    def spec(self) -> StudySpec: ...

    @property
    def policy(self) -> Policy:
        """The decision values in force (optimizer.policy): what its snapshots carry."""
        ...

    def study(self) -> optuna.Study:
        """Optuna's study (the service's screens quarantined trials from its sampler)."""
        ...

    def trials(self) -> list[FrozenTrial]:
        """The trials as the decisions read them (quarantined ones screened)."""
        ...

    def snapshot(self, now: datetime, workers: Sequence[str] = ()) -> conductor.Snapshot | None:
        """The study as the conductor sees it (`workers`: the hosts, where the store does not know them)."""
        ...

    def persist(self, action: conductor.Action, now: datetime) -> None:
        """Write a study-level decision (start or add confirmations, finish); others change nothing.
        The confirmations are queued by optimizer.actions.queue_confirmations."""
        ...

    def settle(self, now: datetime) -> None:
        """Has the study's life moved on (the conductor's `settle`)?  Persisted."""
        ...

    def record_trial(self, asked: AskedTrial, worker_id: str, now: datetime) -> LeaseRecord | PriorLaunch:
        """Record the asked configuration and its trial lease for `worker_id`, or, when the study
        launched the configuration before, that launch (nothing recorded).  Raises NotRecorded."""
        ...

    def set_config_state(self, config_key: str | None, state: ConfigState) -> None: ...

    def queue_retry(self, lease: LeaseRecord, now: datetime) -> None:
        """The trial's next attempt, queued for any host (attempt + 1)."""
        ...

    def levels_measured(self, trial_number: int) -> list[dict[str, Any]]:
        """The most complete set of levels any attempt of the trial measured before it ended."""
        ...

    def requeue_confirm(
        self, lease: LeaseRecord, now: datetime, info: ConfirmInfo, server: ServerSettings | None
    ) -> None:
        """The confirmation's next attempt (attempt + 1), queued for any host with `info`, and
        `server` (None: the server it was queued with)."""
        ...

    def deploy_failures(self) -> list[tuple[SpecConfig, int]]:
        """(configuration, envelope tier) of the study's confirmations that ran out of memory at start-up."""
        ...

    def claim_confirm(
        self, lease: LeaseRecord, action: conductor.Confirm, now: datetime, due: Deployment | None
    ) -> None:
        """The queued confirmation, active for the action's worker, paired with its baseline; `due`:
        the deployment it launches where that differs from the one it was queued with."""
        ...

    def end_lease(self, lease: LeaseRecord, state: str, now: datetime) -> None:
        """The lease ends: completed, failed (a confirmation ends failed unlaunched when every
        envelope left is known to run out of memory) or superseded."""
        ...

    def event(self, kind: str, lease: LeaseRecord, detail: str) -> None: ...
