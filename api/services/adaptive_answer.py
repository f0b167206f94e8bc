"""An adaptive answer as its launch proved it (issue 17 items 1, 3).

When the study's answer is SGLang's adaptive mode (optimizer.deploy), the conductor queues one
more confirmation: that server exactly as printed (optimizer.conductor.adaptive_proof).  This
module reads what became of it for the study document:

* completed: the answer is the server that launch started, its numbers are that launch's
  (against the baseline paired with it), and the verdict names the launch;
* queued or running: the planned adaptive command, saying it is not launched yet;
* failed or given up: the answer falls back to what the other confirmations proved (the static
  winner, or the server without speculation), and the verdict says so first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from api.models import LeaseRow
from optimizer import confirmation as confirm
from optimizer import deploy
from optimizer.analysis import Interval
from optimizer.sglang import ServerSettings
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
    return bool((row.payload.get("confirm") or {}).get("adaptive"))


def outcome(
    spec: StudySpec,
    planned: deploy.Deployment | None,
    rows: Sequence[LeaseRow],
    failures: Sequence[str],
    extra_var: float,
    version: str,
) -> AdaptiveOutcome:
    """What the study's adaptive proof (`rows`: its attempts, oldest first) makes of the answer."""
    if not rows:
        return AdaptiveOutcome()
    done = [r for r in rows if r.state == "completed" and r.result]
    if done:
        return _proven(spec, planned, done[-1], extra_var, version)
    live = [r for r in rows if r.state in ("queued", "active")]
    if live:
        where = "is running" if live[-1].state == "active" else "is queued"
        return AdaptiveOutcome(pending=f"not launched as printed yet: its launch (lease {live[-1].id}) {where}")
    why = failures[-1] if failures else "the adaptive deployment did not start"
    return AdaptiveOutcome(fallback=f"{why}; the answer falls back to what the study's other launches proved")


def _proven(
    spec: StudySpec, planned: deploy.Deployment | None, row: LeaseRow, extra_var: float, version: str
) -> AdaptiveOutcome:
    result: dict[str, Any] = row.result or {}
    settings = ServerSettings.model_validate((result.get("deployment") or {})["server"])
    assert settings.adaptive is not None
    levels = (result.get("metrics") or {}).get("levels") or []
    base = (result.get("confirmation") or {}).get("baseline_levels") or []
    got = confirm.confirm_result(spec, levels, base, extra_var)
    reason = (
        planned.reason
        if planned is not None and planned.mode == "adaptive"
        else "SGLang's adaptive mode: the steps measured best at each concurrency level, 0 where speculation "
        "does not pay"
    )
    dep = deploy.Deployment(
        "adaptive",
        settings,
        True,
        (result.get("metrics") or {}).get("sglang_version") or version,
        reason,
        settings.adaptive.config_doc(),
        tuple(spec.workload.concurrency),
        deploy.load_note(spec, speculation=True),
        proven_by=row.id,
        proof_note="",
    )
    by_level = ", ".join(
        f"{c}: {v:.3f}x{_iv(got.intervals_by_level.get(c))}" for c, v in sorted(got.speedup_by_level.items())
    )
    steps = ", ".join(f"{bs}: {s}" for bs, s in sorted(settings.adaptive.steps_by_batch.items()))
    verdict = (
        f"SGLang's adaptive mode (steps by batch size {steps}), launched exactly as printed (lease {row.id} on "
        f"{row.worker_id}): {got.value:.3f}x{_iv(got.interval)} at concurrency {by_level}"
    )
    return AdaptiveOutcome(proven=dep, verdict=verdict)


def _iv(iv: Interval | None) -> str:
    return "" if iv is None else f" [{iv.low:.3f}-{iv.high:.3f}]"
