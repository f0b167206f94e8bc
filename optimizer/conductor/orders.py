"""What the conductor answers: one action (`Action`) for a worker or for the study."""

from __future__ import annotations

from dataclasses import dataclass, field

from optimizer import deploy
from optimizer.space import SpecConfig
from optimizer.study_state import Ending, FinishReason
from spectune_protocol import Resolve


@dataclass(frozen=True)
class MeasureBaseline:
    """This worker measures the study's baseline (none fresh, or a confirmation needs one)."""

    worker_id: str
    for_confirmation: bool = False


@dataclass(frozen=True)
class RetryLease:
    """This worker takes a queued retry of a trial."""

    lease_id: str


@dataclass(frozen=True)
class Ask:
    """The search goes on: ask the sampler for a configuration."""


@dataclass(frozen=True)
class Candidate:
    trial_number: int | None  # None: the adaptive deployment (several trials' chains)
    config: SpecConfig
    search_speedup: float | None
    avoid_worker: str | None  # the host that found it, when another can confirm it
    # The deployment its confirmation launches: the printed envelope first (issue 17 item 1).
    tier: int = 0
    envelope: deploy.Envelope | None = None
    # The study's adaptive answer as printed (`adaptive_proof`), launched once like any answer.
    adaptive: bool = False


@dataclass(frozen=True)
class StartConfirmation:
    """The search is over: queue these candidates' confirmations, then finish once they are done."""

    ending: Ending
    candidates: tuple[Candidate, ...]


@dataclass(frozen=True)
class Reconfirm:
    """The confirmations are done but the answer straddles its decision on launch noise alone:
    queue one more confirmation launch of these candidates (`relaunches`), then settle again."""

    candidates: tuple[Candidate, ...]
    why: str


@dataclass(frozen=True)
class Confirm:
    """This worker confirms a queued candidate, paired with its baseline `baseline_id`."""

    lease_id: str
    worker_id: str
    baseline_id: int
    # The host's latest baseline, measured after the phase began or just before it with no launch
    # of the study's search on the host since (`baseline_serves`), and the host busy on this
    # study's confirmations since, idle at most `Timing.confirm_idle_s` (`baseline_fresh`).
    fresh_baseline: bool
    # More passes on the warm server while the answer straddles a decision (`resolve_order`).
    resolve: Resolve | None = field(default=None, compare=False)
    # The deployment it launches (`deployment_for`); None: as queued (the adaptive proof), or none
    # is left to try (the claim then drops the candidate without a launch).
    deployment: tuple[int, deploy.Envelope] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Finish:
    ending: Ending

    @property
    def reason(self) -> FinishReason:
        return self.ending.reason

    @property
    def detail(self) -> str:
        return self.ending.detail


@dataclass(frozen=True)
class Wait:
    """Nothing to do now; `reason` says why in words, `warning` when a user must act."""

    reason: str
    warning: str | None = None
    # Asked with `spare=False`: this worker could measure the confirmation's baseline meanwhile
    # (`ready_baseline`); asked again with `spare=True` if no other study has work for it.
    spare_baseline: bool = False


Action = MeasureBaseline | RetryLease | Ask | StartConfirmation | Reconfirm | Confirm | Finish | Wait
