"""What stops a study or leaves it waiting on its hosts: a baseline that fails for what the study asks
(`baseline_fault`), a confirmation no live host can take (`confirmation_waits`)."""

from __future__ import annotations

from optimizer.conductor.snapshot import Snapshot
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.study_state import Ending, FinishReason, Phase, StudyState
from spectune_protocol.printable import printable

# A study whose baseline failed for what it asks on this many hosts, each with a worker token of
# its own, is stopped: the fault follows it.  One token's word is never enough: a stolen unbound
# token once stopped other users' studies with one forged `invalid_config` (issue 35).  The
# policy's `stop_after_hosts`.
STOP_AFTER_HOSTS = DEFAULT_POLICY.stop_after_hosts
# What each study fault means, in the service's own words (the worker's text follows, escaped).
FAULT_WORDS = {
    "invalid_config": "the engine rejected its settings",
    "oom": "out of memory with its settings",
    "launch_timeout": "its server did not start in time",
    "request_rejected": "the engine rejected its benchmark requests",
}


def baseline_fault(
    kind: str, message: str, hosts: int, from_spec: str | None = None, policy: Policy = DEFAULT_POLICY
) -> Ending | None:
    """Does a baseline that failed for what the study asks stop the study?  (None: not yet.)

    After `policy.stop_after_hosts` hosts with their own tokens agree, or at once where the spec itself
    proves the fault (`from_spec`, the service's own reading of the spec, e.g. a workload longer
    than its context length).  The reason shown is the classified one; the worker's text is kept
    after it, control characters escaped (`printable`).  The study is stopped, not finished: fixed
    and created again, it starts from nothing wrong.
    """
    if from_spec is None and hosts < policy.stop_after_hosts:
        return None
    where = from_spec if from_spec is not None else f"on {hosts} hosts with their own worker tokens"
    said = printable(message[:120])
    return Ending(
        FinishReason.STUDY_FAULT,
        f"stopped: its baseline failed ({where}): {FAULT_WORDS.get(kind, kind)} ({kind}; the worker said: {said}); "
        "fix the study's settings and create it again",
    )


def confirmation_waits(snap: Snapshot) -> str | None:
    """A running confirmation that no host can take now, in words (None when one can).

    Shown in the study document's `eligibility.warning` so a confirmation never waits silently.
    """
    if snap.state != StudyState.RUNNING or snap.phase != Phase.CONFIRMATION:
        return None
    queued = [le for le in snap.leases if le.kind == "confirm" and le.state == "queued"]
    if not queued:
        return None
    if snap.live_hosts():
        return None
    refused = sorted(h.id for h in snap.hosts if h.refused)
    held = sorted(h.id for h in snap.hosts if h.quarantined and h.eligible and not h.refused)
    parts = []
    if refused:
        parts.append(f"refused by {', '.join(refused)}")
    if held:
        parts.append(f"quarantined: {', '.join(held)}")
    why = f" ({'; '.join(parts)})" if parts else ""
    return (
        f"{len(queued)} confirmation(s) wait: no live worker that can take this study is polling{why}; "
        "start or fix a worker that can, or stop the study (its search answer stands)"
    )
