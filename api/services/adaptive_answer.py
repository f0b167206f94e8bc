"""An adaptive answer as its launch proved it (issue 17 items 1, 3).

When the study's answer is SGLang's adaptive mode (optimizer.deploy), the conductor queues one
more confirmation: that server exactly as printed (optimizer.conductor.adaptive_proof).  This
module reads what became of it for the study document:

* completed: the answer is the server that launch started, its numbers are that launch's
  (against the baseline paired with it), and the verdict names the launch; `winner_of` makes it
  the study's `best` and `winner` (one record, issue 17 item 5);
* queued or running: the planned adaptive command, saying it is not launched yet;
* failed or given up: the answer falls back to what the other confirmations proved (the static
  winner, or the server without speculation), and the verdict says so first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from optuna.trial import FrozenTrial, TrialState

from api import documents as D
from api.models import LeaseRow
from api.services.lease_rows import LeasePayload
from optimizer import attrs as A
from optimizer import deploy
from optimizer.analysis import Interval
from optimizer.spec import StudySpec


@dataclass(frozen=True)
class AdaptiveOutcome:
    # The adaptive deployment as its launch started it (proven_by set), else None.
    proven: deploy.Deployment | None = None
    verdict: str | None = None  # the proven answer's verdict
    # Its launch is queued or running: the proof note of the planned adaptive command.
    pending: str | None = None
    # It did not start: why, said before the verdict of the fallback answer.
    fallback: str | None = None


def is_adaptive_proof(row: LeaseRow) -> bool:
    return bool(LeasePayload.of(row).confirm_info.adaptive)


def proven(record: D.Confirmation) -> bool:
    """Did the adaptive proof's launch complete with a measurement of the server it started?"""
    return record.state == "completed" and record.speedup is not None and record.server is not None


def outcome(
    spec: StudySpec,
    planned: deploy.Deployment | None,
    rows: Sequence[LeaseRow],
    failures: Sequence[str],
    record: D.Confirmation | None,
    version: str,
) -> AdaptiveOutcome:
    """What the study's adaptive proof (`rows`: its attempts, oldest first; `record`: its entry of
    the document's confirmations) makes of the answer."""
    if not rows:
        return AdaptiveOutcome()
    if record is not None and proven(record):
        row = next((r for r in rows if r.id == record.lease_id), None)
        ran = None if row is None else ((row.result or {}).get("metrics") or {}).get("sglang_version")
        return _proven(spec, planned, record, ran or version)
    live = [r for r in rows if r.state in ("queued", "active")]
    if live:
        where = "is running" if live[-1].state == "active" else "is queued"
        return AdaptiveOutcome(pending=f"not launched as printed yet: its launch (lease {live[-1].id}) {where}")
    why = failures[-1] if failures else "the adaptive deployment did not start"
    return AdaptiveOutcome(fallback=f"{why}; the answer falls back to what the study's other launches proved")


def _proven(
    spec: StudySpec, planned: deploy.Deployment | None, record: D.Confirmation, version: str
) -> AdaptiveOutcome:
    settings = record.server
    assert settings is not None and settings.adaptive is not None
    reason = (
        planned.reason
        if planned is not None and planned.mode == "adaptive"
        else "SGLang's adaptive mode: the steps measured best at each concurrency level, 0 where speculation "
        "does not pay"
    )
    if record.envelope_note:
        # Proven in a smaller graph envelope after the printed one did not start: said with it.
        reason = f"{reason}; the planned envelope did not start, started with {record.envelope_note}"
    dep = deploy.Deployment(
        "adaptive",
        settings,
        True,
        version,
        reason,
        settings.adaptive.config_doc(),
        tuple(spec.workload.concurrency),
        deploy.load_note(spec, speculation=True),
        proven_by=record.lease_id,
        proof_note="",
    )
    # The verdict reads the one record every surface prints (issue 17 item 5).
    ivs = record.speedup_interval_by_level or {}
    by_level = ", ".join(
        f"{c}: {v:.3f}x{_iv(ivs.get(c))}"
        for c, v in sorted((record.speedup_by_level or {}).items(), key=lambda kv: int(kv[0]))
    )
    steps = ", ".join(f"{bs}: {s}" for bs, s in sorted(settings.adaptive.steps_by_batch.items()))
    verdict = (
        f"SGLang's adaptive mode (steps by batch size {steps}), launched exactly as printed (lease "
        f"{record.lease_id} on {record.worker_id}): {record.speedup:.3f}x{_iv(record.speedup_interval)} at "
        f"concurrency {by_level}"
    )
    return AdaptiveOutcome(proven=dep, verdict=verdict)


def winner_of(record: D.Confirmation, static: D.Winner | None, trials: Sequence[FrozenTrial], version: str) -> D.Winner:
    """The answer's one record when it is the adaptive server: its launch's numbers, host and lease.

    `trial_number` names the trial that measured its speculative settings statically (the search
    never ran the adaptive server itself, so there is no search speedup)."""
    settings = record.server
    assert settings is not None and settings.adaptive is not None and record.speedup is not None
    config = settings.speculative or record.config
    assert config is not None
    same = [t for t in trials if A.TrialRecord(t).config_key == config.key and t.state == TrialState.COMPLETE]
    trial = same[0] if same else None
    number = trial.number if trial is not None else (static.trial_number if static is not None else 0)
    return D.Winner(
        trial_number=number,
        params={} if trial is None else dict(trial.params),
        config=config,
        speedup=record.speedup,
        speedup_by_level=record.speedup_by_level,
        speedup_interval_by_level=record.speedup_interval_by_level or {},
        levels=record.levels,
        worker_id=record.worker_id,
        sglang_version=version,
        launch_command=None,
        search_speedup=None,
        speedup_interval=record.speedup_interval,
        confirmed=True,
        confirmed_on=record.worker_id,
        search_worker_id=None,
        lease_id=record.lease_id,
        baseline_levels=record.baseline_levels,
        server=settings,
        envelope_note=record.envelope_note,
        saturated=record.saturated,
        adaptive=True,
        steps_by_batch={str(bs): s for bs, s in sorted(settings.adaptive.steps_by_batch.items())},
    )


def _iv(iv: D.Interval | Interval | None) -> str:
    return "" if iv is None else f" [{iv.low:.3f}-{iv.high:.3f}]"
