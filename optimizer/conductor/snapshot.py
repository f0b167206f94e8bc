"""What the conductor decides from: a study's snapshot (`Snapshot`), its leases, baselines and hosts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any

from optuna.trial import FrozenTrial

from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from optimizer.study_state import Ending, Phase, StudyState
from optimizer.verify_probe import VerifyShape, latest_shapes
from spectune_protocol import LeaseKind, LeaseState


@dataclass(frozen=True)
class LeaseView:
    """A lease of the study, as the conductor needs it."""

    id: str
    kind: LeaseKind
    state: LeaseState
    trial_number: int | None = None
    worker_id: str | None = None
    config_key: str | None = None
    created_at: datetime | None = None
    leased_at: datetime | None = None
    finished_at: datetime | None = None
    avoid_worker: str | None = None  # confirm leases: confirm elsewhere than where it was found
    # A completed confirmation: (levels, paired baseline levels), for the launch-noise estimate.
    measurement: tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]] | None = None
    # Confirm leases: the configuration, the deployment tier it is queued or launched in (None for
    # the adaptive proof, which has no smaller envelope), the server it launches, and why it did
    # not start ("oom"), for the envelope it is handed out in (`deployment_for`).
    config: SpecConfig | None = None
    tier: int | None = None
    server: ServerSettings | None = None
    failure: str | None = None
    # A completed confirmation that another token and host than the search's measured (issue 35).
    independent: bool = True

    @property
    def live(self) -> bool:
        return self.state in ("queued", "active")


@dataclass(frozen=True)
class Baseline:
    """One baseline measurement of a host under the study's baseline key."""

    id: int
    worker_id: str
    measured_at: datetime
    tok_s: Mapping[int, float]  # output tok/s per concurrency level
    # The levels as reported (their passes feed the launch-noise estimate).
    levels: Sequence[Mapping[str, Any]] = ()
    # False for a baseline its host's worker id measured under a previous token (api.services.identity):
    # it counts for the noise estimate, never as this host's baseline.
    valid: bool = True
    # The verify probe its worker timed on the baseline server (spectune_protocol.VerifyProbe as
    # JSON; None from a worker without it): the verify cost's shape (optimizer.verify_probe).
    verify_probe: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class HostView:
    """A registered worker, as far as this study goes."""

    id: str
    last_seen: datetime | None
    quarantined: bool = False
    # Meets the study's requirements (models, placement, GPUs) and did not refuse it.
    eligible: bool = True
    refused: bool = False
    # Its lease was reclaimed because it went silent (missed heartbeats, or the lease's deadline)
    # and it has not been heard from since: not waited for, however recently it was seen
    # (docs/leases.md "Lost workers").
    lost: bool = False
    # The worker token that speaks for this worker id (api.services.identity), where known: one
    # unbound token may use several worker ids, and "another host" means another token (issue 35).
    token: int | None = None


@dataclass(frozen=True)
class Timing:
    """The service's settings the conductor reads (api.settings)."""

    baseline_max_age_s: float = 6 * 3600.0
    # A worker not seen for this long is not waited for (3 lease lifetimes by default).
    live_window_s: float = 360.0
    # A confirmation pairs only with a baseline its host measured at most this long before, not
    # counting the time the host spent confirming this study's candidates since: a host that sat
    # idle (or ran other work) for longer measures a new one.
    confirm_idle_s: float = 600.0


@dataclass(frozen=True)
class Snapshot:
    spec: StudySpec
    state: StudyState
    phase: Phase
    created_at: datetime
    now: datetime
    trials: Sequence[FrozenTrial]
    launched: frozenset[str]  # config keys launched (what the budget counts)
    leases: Sequence[LeaseView]  # live leases of every kind, and every confirm lease
    baselines: Sequence[Baseline]  # every baseline under the study's key, oldest first
    hosts: Sequence[HostView] = ()
    timing: Timing = field(default_factory=Timing)
    # In confirmation: when it began and why the search ended.
    confirmation_began_at: datetime | None = None
    ending: Ending | None = None
    # Per host, when its latest search launch of this study ended (a baseline measured before it
    # does not pair with a confirmation: `baseline_serves`).
    search_done: Mapping[str, datetime] = field(default_factory=dict)
    # The decision values in force (optimizer.policy): the rules read them from here.
    policy: Policy = DEFAULT_POLICY

    @property
    def in_flight(self) -> list[LeaseView]:
        """The search launches queued or running."""
        return [le for le in self.leases if le.kind == "trial" and le.live]

    def latest_baseline(self, worker_id: str) -> Baseline | None:
        mine = [b for b in self.baselines if b.worker_id == worker_id and b.valid]
        return max(mine, key=lambda b: b.measured_at) if mine else None

    def verify_shapes(self) -> dict[str, VerifyShape]:
        """Each host's newest probed verify cost shape: what every fit of the study reads
        (the sampler's, the stop rule's, the ranking's), and the study document's winner too."""
        return self._shapes

    @cached_property
    def _shapes(self) -> dict[str, VerifyShape]:
        # Read once per snapshot: one decision asks for it several times (stop rule, believer,
        # ranking), and a snapshot's baselines do not change under it.
        return latest_shapes(self.baselines)

    def host(self, worker_id: str) -> HostView | None:
        return next((h for h in self.hosts if h.id == worker_id), None)

    def live_hosts(self) -> list[HostView]:
        since = self.now - timedelta(seconds=self.timing.live_window_s)
        return [
            h
            for h in self.hosts
            if h.eligible
            and not h.refused
            and not h.quarantined
            and not h.lost
            and h.last_seen is not None
            and h.last_seen >= since
        ]
