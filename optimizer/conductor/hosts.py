"""Which host confirms, next to which baseline: a baseline's freshness and drift, the hosts that may
take a candidate, and the study's launch noise its re-launches measure (`launch_noise`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import timedelta
from statistics import NormalDist
from typing import Any

from optimizer import confirmation as confirm
from optimizer.analysis import LaunchNoise
from optimizer.conductor.snapshot import Baseline, LeaseView, Snapshot


def launch_noise(snap: Snapshot) -> LaunchNoise:
    """The study's launch-to-launch noise from its re-launches: every baseline of its server (any
    study's) and every completed confirmation (optimizer.confirmation.study_noise)."""
    return confirm.study_noise(
        snap.trials,
        [(b.worker_id, b.levels) for b in snap.baselines],
        [
            (str(le.config_key), le.measurement[0], le.measurement[1])
            for le in snap.leases
            if le.kind == "confirm" and le.state == "completed" and le.measurement is not None
        ],
        snap.spec.objective,
        snap.policy,
    )


def pairs_again(snap: Snapshot, worker_id: str, lease: LeaseView) -> bool:
    """Would this re-launch pair with a baseline an earlier confirmation of the same candidate on
    this host already used?  Then it is not an independent launch: a fresh baseline comes first."""
    base = snap.latest_baseline(worker_id)
    return base is not None and any(
        le.trial_number == lease.trial_number
        and le.worker_id == worker_id
        and le.finished_at is not None
        and le.finished_at >= base.measured_at
        for le in completed_confirms(snap)
    )


def confirming_hosts(snap: Snapshot) -> set[str]:
    """Live hosts in this study's confirmation: holding a fresh baseline, measuring one, or
    confirming (a host that went away drops out, and another takes its place)."""
    active = {le.worker_id for le in snap.leases if le.state == "active" and le.kind in ("baseline", "confirm")}
    return {h.id for h in snap.live_hosts() if h.id in active or holds_fresh_baseline(snap, h.id)}


def may_take(snap: Snapshot, worker_id: str, lease: LeaseView) -> bool:
    """May this host confirm `lease`?  Not the host that found it, nor another worker id of its
    token, while a host of another token can."""
    found = lease.avoid_worker
    return not (found is not None and same_token(snap, worker_id, found) and another_host_can_confirm(snap, found))


def same_token(snap: Snapshot, a: str, b: str) -> bool:
    """Do these worker ids speak for one token (or are they one id)?  Unknown tokens: ids alone."""
    ha, hb = snap.host(a), snap.host(b)
    return a == b or (ha is not None and hb is not None and ha.token is not None and ha.token == hb.token)


def holds_fresh_baseline(snap: Snapshot, worker_id: str) -> bool:
    base = snap.latest_baseline(worker_id)
    return base is not None and baseline_serves(snap, worker_id, base) and baseline_fresh(snap, worker_id, base)


def unclaimed(snap: Snapshot, worker_id: str, queued: Sequence[LeaseView]) -> list[LeaseView]:
    """The queued confirmations left once every other live host that holds a fresh baseline, is
    measuring one, or is confirming has claimed those it may take: it confirms them one after
    another next to its one fresh baseline."""
    left = list(queued)
    for other in confirming_hosts(snap) - {worker_id}:
        left = [le for le in left if not may_take(snap, other, le)]
    return left


def with_baseline(snap: Snapshot) -> set[str]:
    """Hosts with a valid baseline under the study's key."""
    return {b.worker_id for b in snap.baselines if b.valid}


def another_host_takes_all(snap: Snapshot, worker_id: str, queued: Sequence[LeaseView]) -> bool:
    """Could another live host with a baseline confirm every queued candidate, where this one may
    not (it found one of them)?  Then this one leaves the confirmation to it: one fresh baseline
    instead of two, and the candidates compared on one host, where no host offset tells them apart.

    Only for as long after the confirmation began as a worker not seen is waited for
    (`Timing.live_window_s`): the other host may be busy with another study's work, or never come
    back to this one, and then this one measures its own fresh baseline."""
    if all(may_take(snap, worker_id, le) for le in queued):
        return False
    began = snap.confirmation_began_at
    if began is not None and snap.now - began > timedelta(seconds=snap.timing.live_window_s):
        return False
    holders = with_baseline(snap)
    return any(
        h.id != worker_id and h.id in holders and all(may_take(snap, h.id, le) for le in queued)
        for h in snap.live_hosts()
    )


def another_host_can_confirm(snap: Snapshot, worker_id: str) -> bool:
    """Is another live, healthy, eligible host of another token that has not refused the study
    around to confirm?"""
    holders = with_baseline(snap)
    return any(not same_token(snap, h.id, worker_id) and h.id in holders for h in snap.live_hosts())


def baseline_serves(snap: Snapshot, worker_id: str, base: Baseline) -> bool:
    """May this host's latest baseline pair with its next confirmation?

    One baseline measured after the confirmation began, or before it with no launch of the
    study's search on the host since (a host the search left idle measures it while the last
    launches fly: `ready_baseline`), serves every confirmation on a host, as long as it stays
    fresh (`baseline_fresh`: at most `Timing.confirm_idle_s` idle since, other studies' work
    counting as idle time, as it always did).  Where the host's baseline drifted (it differs from the host's last one before
    it beyond the study's launch noise: `drifted`) each confirmation needs one measured after the previous
    confirmation ended (`optimizer.confirmation.baseline_serves`).
    """
    began = snap.confirmation_began_at
    if began is None:
        return False
    ended = [le.finished_at for le in snap.leases if le.kind == "confirm" and le.worker_id == worker_id]
    last = max((t for t in ended if t is not None), default=None)
    before = min(began, base.measured_at)
    earlier = [b for b in snap.baselines if b.worker_id == worker_id and b.valid and b.measured_at < before]
    prev = max(earlier, key=lambda b: b.measured_at) if earlier else None
    drift = prev is not None and drifted(snap, base, prev)
    searched = snap.search_done.get(worker_id)
    return confirm.baseline_serves(
        base.measured_at.timestamp(),
        began.timestamp(),
        None if searched is None else searched.timestamp(),
        None if last is None else last.timestamp(),
        drift,
    )


def drifted(snap: Snapshot, base: Baseline, prev: Baseline) -> bool:
    """Did the host's baseline move from `prev` to `base` beyond the study's launch noise
    (`optimizer.confirmation.drift_seen`, two-sided at `policy.drift_level`)?

    The noise is estimated without `base` (`launch_noise`): a real move would otherwise widen
    the very noise it is judged against (one pair of the host's baselines 5% apart lifted the
    estimate enough to hide it).  A move the least noise the estimate ever gives
    (the policy's `min_launch_sd`) explains is no drift, and needs no estimate.
    """
    fresh, earlier = _levels(base), _levels(prev)
    z = NormalDist().inv_cdf(0.5 + snap.policy.drift_level / 2.0)
    if not confirm.drift_seen(fresh, earlier, snap.policy.min_launch_sd**2, z):
        return False
    without = dataclasses.replace(snap, baselines=tuple(b for b in snap.baselines if b.id != base.id))
    return confirm.drift_seen(fresh, earlier, launch_noise(without).variance, z)


def baseline_fresh(snap: Snapshot, worker_id: str, base: Baseline) -> bool:
    """Was the host busy confirming this study since `base`, idle no longer than `confirm_idle_s`?

    A baseline measured right after the confirmation began but followed by half an hour of the
    host doing nothing (or other studies' work) is not "fresh": the host measures a new one.
    """
    busy = 0.0
    for le in snap.leases:
        if le.kind != "confirm" or le.worker_id != worker_id or le.finished_at is None or le.leased_at is None:
            continue
        if le.finished_at >= base.measured_at:
            start = max(le.leased_at, base.measured_at)
            busy += max(0.0, (le.finished_at - start).total_seconds())
    idle = (snap.now - base.measured_at).total_seconds() - busy
    return idle <= snap.timing.confirm_idle_s


def _levels(b: Baseline) -> list[Mapping[str, Any]]:
    """The baseline's levels as reported (with their passes), or its tok/s alone."""
    if b.levels:
        return list(b.levels)
    return [{"concurrency": c, "output_tok_s": v} for c, v in b.tok_s.items()]


def completed_confirms(snap: Snapshot) -> list[LeaseView]:
    done = [
        le
        for le in snap.leases
        if le.kind == "confirm"
        and le.state == "completed"
        and le.measurement is not None
        and le.trial_number is not None
    ]
    return sorted(done, key=lambda le: (le.finished_at or snap.now, le.id))
