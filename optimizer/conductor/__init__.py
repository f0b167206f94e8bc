"""The study conductor: one pure function of a study's snapshot to its next action.

Nothing here touches a database, a clock or the network: `api.services.study_life` loads a
`Snapshot` under the study's lock, asks `next_action` (what this worker should do now) or
`settle` (has the study's life moved on?), and persists the answer; the search-efficiency
benchmark drives the same functions with an in-memory store.  Every decision about a study's life
lives in this package, a module per phase, and this module reads the life in one screen:

    SEARCH ──budget | stop rule | patience | space used──▶ CONFIRMATION ──all confirmed or given up──▶ FINISHED
       │                                                                                               ▲
       └── stop rule says "does not pay", or nothing to confirm ───────────────────────────────────────┘

* `snapshot`: what a decision sees; `orders`: what it answers (`Action`).
* `search`: the search phase; the stop rule (optimizer.convergence) through its one seam,
  `stop_rule`; what a worker asking in the search is told; why the search ends.
* `confirming`: the confirmation phase; which candidates, the extra launches of a straddling
  winner, the answer, which queued confirmation a worker takes.
* `deployments`: the envelope a confirmation launches in, and which confirmations launch at once.
* `hosts`: which host confirms next to which baseline (freshness, drift), the study's launch noise.
* `faults`: a baseline that fails for what the study asks; a confirmation no host can take.
"""

from __future__ import annotations

from datetime import timedelta

from optimizer.conductor import confirming, search
from optimizer.conductor.confirming import (
    adaptive_proof,
    candidates,
    contenders,
    extra_launches,
    relaunched,
    relaunches,
    resolve_order,
    winner,
)
from optimizer.conductor.deployments import EnvelopeKey, deploy_failures, deployment_for, envelope_key, next_deployment
from optimizer.conductor.faults import FAULT_WORDS, STOP_AFTER_HOSTS, baseline_fault, confirmation_waits
from optimizer.conductor.hosts import baseline_fresh, baseline_serves, drifted, launch_noise, same_token
from optimizer.conductor.orders import (
    Action,
    Ask,
    Candidate,
    Confirm,
    Finish,
    MeasureBaseline,
    Reconfirm,
    RetryLease,
    StartConfirmation,
    Wait,
)
from optimizer.conductor.search import (
    BELIEF_MARGIN,
    MODEL_PARALLEL,
    believed_settles,
    converges,
    in_flight_settles,
    launches_needed,
    parallel_cap,
    patience_reason,
    ready_baseline,
    search_over,
    space_exhausted,
    stop_rule,
)
from optimizer.conductor.snapshot import Baseline, HostView, LeaseView, Snapshot, Timing
from optimizer.study_state import Phase, StudyState

__all__ = [
    "BELIEF_MARGIN",
    "FAULT_WORDS",
    "MODEL_PARALLEL",
    "STOP_AFTER_HOSTS",
    "Action",
    "Ask",
    "Baseline",
    "Candidate",
    "Confirm",
    "EnvelopeKey",
    "Finish",
    "HostView",
    "LeaseView",
    "MeasureBaseline",
    "Reconfirm",
    "RetryLease",
    "Snapshot",
    "StartConfirmation",
    "Timing",
    "Wait",
    "adaptive_proof",
    "baseline_fault",
    "baseline_fresh",
    "baseline_serves",
    "believed_settles",
    "candidates",
    "confirmation_waits",
    "contenders",
    "converges",
    "deploy_failures",
    "deployment_for",
    "drifted",
    "envelope_key",
    "extra_launches",
    "in_flight_settles",
    "launch_noise",
    "launches_needed",
    "next_action",
    "next_deployment",
    "parallel_cap",
    "patience_reason",
    "ready_baseline",
    "relaunched",
    "relaunches",
    "resolve_order",
    "same_token",
    "search_over",
    "settle",
    "space_exhausted",
    "stop_rule",
    "winner",
]


def next_action(snap: Snapshot, worker_id: str, *, spare: bool = True) -> Action:
    """What `worker_id` should do for this study now.

    `spare`: the worker has no other study's work to do.  A worker that is not spare is told to
    wait rather than measure a confirmation's baseline ahead of time (`search.ready_baseline`),
    with `Wait.spare_baseline` saying one is there: the service asks the other studies first.

    `StartConfirmation` and `Finish` are the study's, not the worker's: the caller persists them
    and asks again (a study that moved to confirmation may have a confirmation for this worker).
    """
    if snap.state != StudyState.RUNNING:
        return Wait(f"the study is {snap.state.value}")
    base = snap.latest_baseline(worker_id)
    if base is None or base.measured_at < snap.now - timedelta(seconds=snap.timing.baseline_max_age_s):
        return MeasureBaseline(worker_id)
    retry = min(
        (le for le in snap.leases if le.kind == "trial" and le.state == "queued"),
        key=lambda le: (le.created_at or snap.now, le.id),
        default=None,
    )
    if retry is not None:
        return RetryLease(retry.id)
    if snap.phase == Phase.CONFIRMATION:
        queued = confirming.confirmation_for(snap, worker_id)
        if queued is not None:
            return queued
        moved = settle(snap)
        return Wait("this study's confirmations are running elsewhere") if isinstance(moved, Ask) else moved
    going = search.searching(snap, worker_id, spare)
    if going is not None:
        return going
    moved = settle(snap)
    if isinstance(moved, Ask):
        # The rule settled with launches in flight: the confirmation starts when they are in.
        moved = Wait("launches of this study are still in flight")
    if isinstance(moved, Wait) and snap.in_flight:
        return search.spare_or_wait(snap, worker_id, moved, spare)
    return moved


def settle(snap: Snapshot) -> Action:
    """Has the study's life moved on?  `Finish`, `StartConfirmation`, `Reconfirm`, `Wait` (launches
    in flight, or confirmations to run) or `Ask` (the search goes on)."""
    if snap.state != StudyState.RUNNING:
        return Wait(f"the study is {snap.state.value}")
    assessment = (
        stop_rule(snap.spec, snap.trials, snap.policy, snap.verify_shapes()) if snap.phase == Phase.SEARCH else None
    )
    if any(le.live and le.kind != "baseline" for le in snap.leases):
        return Wait("launches of this study are still in flight")
    if search.unleased_running(snap):
        return Wait("a trial asked from the sampler has no lease yet")
    if snap.phase == Phase.CONFIRMATION:
        return confirming.done(snap)
    ending = search.search_ending(snap, assessment)
    return Ask() if ending is None else confirming.start(snap, ending)
