"""Confirmation leases: the best candidates re-measured, each next to a fresh baseline.

Queued by the conductor (optimizer.conductor, persisted by api.services.study_life) once the
search is over; which worker confirms which candidate, and with which baseline, is the
conductor's `Confirm` (or a `MeasureBaseline` first).  This module claims, completes and retries.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from optuna.trial import FrozenTrial
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.context import ServiceContext, Unit
from api.db import db_now
from api.models import BaselineRow, LeaseRow
from api.services import lease_rows, study_life
from api.services.launch_noise import study_noise
from api.services.lease_rows import ConfirmInfo, LeasePayload
from api.services.leasing import records
from api.services.leasing.records import CONFIG_FAILURES, DEPLOY_FAILED, DEPLOY_RETRY, HostHealth, event
from api.services.leasing.states import LeaseKind, LeaseState, claim, end
from api.services.study_specs import baseline_key_of, study_trials
from optimizer import attrs as A
from optimizer import confirmation as confirm
from optimizer import deploy
from optimizer.conductor import Confirm, next_deployment
from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from spectune_protocol import CompleteIn, CompleteOut

log = logging.getLogger("spectune.api.leasing")


class ConfirmLeases:
    def __init__(self, ctx: ServiceContext, health: HostHealth) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.health = health

    def claim(
        self, s: Session, spec: StudySpec, action: Confirm, now: datetime, trials: Sequence[FrozenTrial] = ()
    ) -> LeaseRow | None:
        """The conductor's `Confirm`: the queued confirmation, now active for its worker and paired
        with the baseline the conductor chose (None when another request took it meanwhile)."""
        lease = s.get(LeaseRow, action.lease_id, with_for_update=True)
        if lease is None or lease.state != LeaseState.QUEUED:
            return None
        stored = LeasePayload.of(lease)
        info = (stored.confirm or ConfirmInfo()).model_copy(
            update={"baseline_id": action.baseline_id, "baseline_fresh": action.fresh_baseline}
        )
        base = s.get(BaselineRow, action.baseline_id)
        assert base is not None
        payload = stored.model_copy(update={"confirm": info})
        if action.resolve is not None:
            # The conductor's order: more passes on the warm server while the answer straddles a decision.
            payload = payload.model_copy(update={"resolve": action.resolve})
        # What the study's deployments taught since it was queued: skip an envelope known to fail.
        if payload.config is not None and info.tier is not None:
            # The conductor's deployment (one launch at a time in an envelope nothing started in);
            # without one, what the study's failures leave.
            due = action.deployment or next_deployment(
                spec,
                payload.config,
                deploy_failures(s, spec.name),
                info.tier - 1,
                trials,
            )
            if due is None:
                # Every envelope left is known to run out of memory: launching the queued one
                # would only repeat a known failure.  The candidate is out, without a launch.
                cfg = payload.config
                end(s, lease, LeaseState.FAILED, now)
                event(
                    s,
                    DEPLOY_FAILED,
                    lease,
                    f"{cfg.num_steps}/{cfg.topk}/{cfg.num_draft_tokens} was not launched: a configuration needing "
                    "no more graph memory ran out of memory in every graph envelope the serving section leaves; "
                    "it cannot be the answer",
                )
                return None
            if due[0] != info.tier:
                tier, env = due
                info = info.model_copy(update={"tier": tier, "envelope_note": env.note})
                payload = payload.model_copy(update={"confirm": info, "server": env.settings})
        claim(s, lease, action.worker_id, now, self.settings.lease_ttl_s, payload=payload.doc())
        log.info(
            "lease %s: study %s confirms trial %s on %s", lease.id, spec.name, lease.trial_number, action.worker_id
        )
        return lease

    def complete(self, u: Unit, spec: StudySpec, lease_id: str, body: CompleteIn, late: bool) -> CompleteOut:
        """A candidate re-measured: its speedup and interval against the baseline paired with it."""
        trials = study_trials(self.ctx.storage, self.ctx.sessions, spec.name)
        with u.step() as s:
            now = db_now(s)
            lease = s.get(LeaseRow, lease_id)
            assert lease is not None and lease.worker_id is not None
            info = dict(lease.payload.get("confirm") or {})
            key = baseline_key_of(spec)
            base_row = s.get(BaselineRow, info["baseline_id"]) if "baseline_id" in info else None
            # Only the baseline the conductor paired it with is called fresh.
            fresh = base_row is not None and bool(info.get("baseline_fresh"))
            if base_row is None:
                base_row = records.latest_baseline(s, lease.worker_id, key)
            if late:
                for other in s.scalars(
                    select(LeaseRow).where(
                        LeaseRow.study_name == spec.name,
                        LeaseRow.kind == LeaseKind.CONFIRM,
                        LeaseRow.trial_number == lease.trial_number,
                        LeaseRow.state.in_((LeaseState.QUEUED, LeaseState.ACTIVE)),
                        LeaseRow.id != lease.id,
                    )
                ):
                    end(s, other, LeaseState.SUPERSEDED, now)
                event(s, "late_report_kept", lease, f"confirmation of trial {lease.trial_number} reported late")
            if body.outcome == "ok" and body.metrics is not None and base_row is not None:
                levels = [lv.model_dump(mode="json") for lv in body.metrics.levels]
                base_levels = base_row.metrics.get("levels", [])
                noise = study_noise(s, spec, trials)
                result = confirm.confirm_result(spec, levels, base_levels, noise.variance)
                stored: dict[str, Any] = {
                    **body.model_dump(mode="json"),
                    "confirmation": {
                        **result.as_json(),
                        "baseline_id": base_row.id,
                        "baseline_lease_id": base_row.lease_id,
                        "baseline_measured_at": base_row.measured_at.isoformat(),
                        "baseline_fresh": fresh,
                        "baseline_levels": base_levels,
                        # Why this launch is no independent confirmation, or None (issue 35).
                        "not_independent": not_independent(s, lease, base_row, trials),
                    },
                    # The server this launch started: the deployment it proves (issue 17 item 1).
                    "deployment": {
                        "tier": info.get("tier"),
                        "note": info.get("envelope_note") or "",
                        "server": lease.payload.get("server"),
                        "adaptive": bool(info.get("adaptive")),
                    },
                }
                end(s, lease, LeaseState.COMPLETED, now, speedup=result.value, result=stored)
                self.health.success(s, lease.worker_id)
            else:
                end(s, lease, LeaseState.FAILED, now, result=body.model_dump(mode="json"))
                failure = body.failure
                reason = "no baseline to pair with" if failure is None else f"{failure.kind}: {failure.message}"
                if failure is not None and (failure.host_fault or failure.kind not in CONFIG_FAILURES):
                    if records.counts_against_host(failure.kind):
                        self.health.failure(s, lease.worker_id, reason)
                    self.retry(s, lease, now, reason)
                elif failure is not None and failure.kind in ("oom", "launch_timeout") and "tier" in info:
                    self.next_envelope(s, spec, lease, now, failure.kind, failure.message, trials)
                elif failure is not None and info.get("adaptive"):
                    self.next_adaptive_envelope(s, spec, lease, now, failure.kind, failure.message)
                else:
                    event(s, "confirm_failed", lease, reason)
            study_life.settle(s, spec, now, trials, self.settings)
            return CompleteOut(lease_id=lease.id, state=lease.state, speedup=lease.speedup)

    def next_envelope(
        self,
        s: Session,
        spec: StudySpec,
        lease: LeaseRow,
        now: datetime,
        kind: str,
        message: str,
        trials: Sequence[FrozenTrial] = (),
    ) -> None:
        """The deployment did not start: the same configuration in the next smaller graph envelope
        the serving section allows, or, when none is left, the candidate is out (stated)."""
        info = dict(lease.payload.get("confirm") or {})
        cfg = SpecConfig.model_validate(lease.payload["config"])
        why = deploy.deployment_failure(kind, message)
        tried = int(info["tier"])
        due = next_deployment(spec, cfg, deploy_failures(s, spec.name), tried, trials)
        label = f"{cfg.num_steps}/{cfg.topk}/{cfg.num_draft_tokens}"
        if due is None:
            event(
                s,
                DEPLOY_FAILED,
                lease,
                f"{label} did not start as it would be deployed ({why}), and the serving envelope leaves no "
                "smaller graph envelope to try: it cannot be the answer",
            )
            return
        tier, env = due
        info = _unpaired(info)
        info |= {"tier": tier, "envelope_note": env.note}
        _requeue(s, lease, {**lease.payload, "confirm": info, "server": env.settings.model_dump(mode="json")}, now)
        event(s, DEPLOY_RETRY, lease, f"{label} did not start as it would be deployed ({why}); trying {env.note}")

    def next_adaptive_envelope(
        self, s: Session, spec: StudySpec, lease: LeaseRow, now: datetime, kind: str, message: str
    ) -> None:
        """The adaptive server did not start: out of memory or a time-out (graph capture), the
        same server with smaller CUDA graphs where the serving envelope allows; anything else, or
        nothing smaller left, and the answer falls back to what was proven (api.services.studies)."""
        why = deploy.deployment_failure(kind, message)
        server = lease.payload.get("server")
        smaller = (
            deploy.smaller_envelope(spec, ServerSettings.model_validate(server))
            if kind in ("oom", "launch_timeout") and server is not None
            else None
        )
        if smaller is None:
            event(s, deploy.ADAPTIVE_FAILED, lease, f"the adaptive deployment did not start ({why}: {message[:300]})")
            return
        info = _unpaired(lease.payload.get("confirm") or {}) | {"envelope_note": smaller.note}
        payload = {**lease.payload, "confirm": info, "server": smaller.settings.model_dump(mode="json")}
        _requeue(s, lease, payload, now)
        event(
            s, DEPLOY_RETRY, lease, f"the adaptive deployment did not start as printed ({why}); trying {smaller.note}"
        )

    def retry(self, s: Session, lease: LeaseRow, now: datetime, reason: str) -> None:
        """Queue a confirmation again (its baseline pairing is redone), up to max_attempts."""
        if lease.attempt >= self.settings.max_attempts:
            event(s, "confirm_given_up", lease, f"{reason}; gave up after {lease.attempt} attempts")
            if (lease.payload.get("confirm") or {}).get("adaptive"):
                event(
                    s,
                    deploy.ADAPTIVE_FAILED,
                    lease,
                    f"the adaptive deployment was not measured: {reason}; gave up after {lease.attempt} attempts",
                )
            return
        _requeue(s, lease, {**lease.payload, "confirm": _unpaired(lease.payload.get("confirm") or {})}, now)
        event(s, "confirm_requeued", lease, f"{reason}; attempt {lease.attempt + 1} queued")


def _unpaired(info: dict[str, Any]) -> dict[str, Any]:
    """A confirmation's info without its baseline pairing: the next attempt is paired again."""
    return {k: v for k, v in info.items() if k not in ("baseline_id", "baseline_fresh")}


def _requeue(s: Session, lease: LeaseRow, payload: dict[str, Any], now: datetime) -> None:
    """The next attempt of a confirmation, queued for any host (the conductor pairs it again)."""
    s.add(
        LeaseRow(
            id=lease_rows.new_lease_id(),
            study_name=lease.study_name,
            kind=LeaseKind.CONFIRM.value,
            state=LeaseState.QUEUED.value,
            worker_id=None,
            trial_number=lease.trial_number,
            attempt=lease.attempt + 1,
            config_key=lease.config_key,
            payload=payload,
            created_at=now,
        )
    )


def deploy_failures(s: Session, study: str) -> list[tuple[SpecConfig, int]]:
    """(configuration, envelope tier) of the study's confirmations that ran out of memory at start-up."""
    out = []
    for r in s.scalars(
        select(LeaseRow).where(
            LeaseRow.study_name == study, LeaseRow.kind == LeaseKind.CONFIRM, LeaseRow.state == LeaseState.FAILED
        )
    ):
        failure = (r.result or {}).get("failure") or {}
        info = r.payload.get("confirm") or {}
        if failure.get("kind") == "oom" and "tier" in info and r.payload.get("config"):
            out.append((SpecConfig.model_validate(r.payload["config"]), int(info["tier"])))
    return out


def not_independent(s: Session, lease: LeaseRow, base_row: BaselineRow, trials: Sequence[FrozenTrial]) -> str | None:
    """Why this confirmation does not vouch for its candidate independently, or None when it does.

    It counts only when another token *and* another worker id than the search launch's measured
    it, next to a baseline its own token reported: one stolen unbound token once found a forged
    candidate as `liar-1` and confirmed it as `liar-2` (issue 35).  Leases from before migration
    0007 carry no token; then the worker ids alone decide.
    """
    base_lease = s.get(LeaseRow, base_row.lease_id)
    base_token = None if base_lease is None else base_lease.token_id
    if base_token != lease.token_id or base_row.worker_id != lease.worker_id:
        return "its baseline was reported by another token or host than the confirmation"
    if lease.trial_number is None:
        return None  # the adaptive proof: several trials' chains, found by no one host
    found = next((t for t in trials if t.number == lease.trial_number), None)
    record = None if found is None else A.TrialRecord(found)
    finder = None if record is None else record.worker_id
    trial_lease = None if record is None or record.lease_id is None else s.get(LeaseRow, record.lease_id)
    finder_token = None if trial_lease is None else trial_lease.token_id
    if finder_token is not None and finder_token == lease.token_id:
        return "re-measured only by the worker token that found it (one token serves this study)"
    if finder == lease.worker_id:
        return "re-measured only on the host that found it"
    return None
