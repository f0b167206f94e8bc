"""Carrying out the conductor's actions, once, over a `StudyStore` (optimizer/store.py).

The conductor (optimizer.conductor) decides what a study does next; this module does it on
whichever store holds the study: the service's (api/services/leasing, on its database) and the
rehearsal's in memory (optimizer/rehearsal.py: benchmarks, `spectune study plan`).  Both run the
same asks, tells, retries and envelopes, so a benchmark measures the service's own procedure.

* `ask`: a configuration not launched yet, leased to a worker; a proposal launched before is
  answered from its earlier trial, one known to run out of memory is told infeasible unlaunched.
* `tell_measured` / `tell_failure`: a trial's report told to Optuna.
* `retry_or_give_up`: a trial's next attempt, or its failure with what the attempts measured.
* `queue_confirmations`: the confirmations the conductor starts (StartConfirmation, Reconfirm).
* `claim_confirm`, `confirm_failed`, `next_envelope`, `next_adaptive_envelope`, `retry_confirm`:
  a confirmation's deployment, and what follows a launch that did not start or did not report.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from optimizer import attrs as A
from optimizer import deploy
from optimizer import study as opt
from optimizer.conductor import Candidate, Confirm, next_deployment
from optimizer.errors import TrialStateError
from optimizer.infeasible import known_to_fail, oom_points
from optimizer.objective import CONSTRAINT_KEY, score_levels
from optimizer.spec import StudySpec
from optimizer.store import (
    CONFIG_FAILURES,
    DEPLOY_FAILED,
    DEPLOY_RETRY,
    ConfigState,
    ConfirmInfo,
    ConfirmQueue,
    GiveUp,
    LeaseRecord,
    NotRecorded,
    PriorLaunch,
    QueuedConfirm,
    StudyStore,
)

log = logging.getLogger("spectune.actions")

# Proposals that turn out to be a configuration already launched are answered without a launch;
# bound the loop so a nearly exhausted space cannot spin.
MAX_DUPLICATE_PROPOSALS = 12

# Failures a confirmation's deployment may answer with a smaller graph envelope.
START_FAILURES = ("oom", "launch_timeout")

# ------------------------------------------------------------------------------------ trials


def ask(store: StudyStore, worker_id: str, now: datetime) -> tuple[LeaseRecord, opt.AskedTrial] | None:
    """The conductor's `Ask`: a configuration not launched yet, leased to `worker_id`.

    None when the lease could not be had now (the asked trial is told FAIL), or when every one of
    MAX_DUPLICATE_PROPOSALS proposals was launched before or is known to run out of memory (the
    space may be used up: the study is settled).  Raises NotRecorded when the worker got another
    lease concurrently.
    """
    spec = store.spec
    for _ in range(MAX_DUPLICATE_PROPOSALS):
        # The service's study screens quarantined trials (api.services.trial_records.sampler_screen).
        study = store.study()
        asked = opt.ask(study, spec)
        # Screened: a quarantined OOM proves nothing about the region around it.
        proof = known_to_fail(asked.config, oom_points(store.trials()))
        if proof is not None:
            # Needs at least the memory of a configuration that ran out of it: no launch.
            opt.tell_infeasible(
                study,
                asked.number,
                {
                    A.INFERRED_FROM: proof.trial_number,
                    A.FAILURE_KIND: "oom",
                    A.FAILURE_MESSAGE: f"not launched: needs at least the GPU memory of trial "
                    f"{proof.trial_number} ({proof.config.key}), which ran out of memory",
                },
            )
            log.info("study %s trial %d %s: skipped, known to run out of memory (trial %d)",
                     spec.name, asked.number, asked.config.key, proof.trial_number)  # fmt: skip
            continue
        try:
            got = store.record_trial(asked, worker_id, now)
        except NotRecorded as e:
            opt.tell_failed(study, asked.number, {A.FAILURE_KIND: "not_leased", A.FAILURE_MESSAGE: e.reason})
            if e.worker_busy:
                raise
            return None
        except BaseException:
            # Never leave a RUNNING trial behind that no lease will ever finish.
            opt.tell_failed(
                study, asked.number, {A.FAILURE_KIND: "not_leased", A.FAILURE_MESSAGE: "lease could not be recorded"}
            )
            raise
        if isinstance(got, PriorLaunch):
            answer_duplicate(study, asked, got)
            continue
        return got, asked
    # Every proposal was a duplicate or known to fail: the space may be used up.
    store.settle(now)
    return None


def answer_duplicate(study: optuna.Study, asked: opt.AskedTrial, prior: PriorLaunch) -> None:
    """The sampler proposed a configuration already launched: answer it from that launch, no restart."""
    if prior.trial_number == asked.number:
        # The same trial handed out twice (two asks popped one enqueued trial): the other ask
        # holds it and its lease will report it.  Telling it here would finish a trial whose
        # lease is live, and its worker would be told 409 on every progress call.
        log.error("study %s: trial %d was handed out twice; leaving it to its lease", study.study_name, asked.number)
        return
    attrs: dict[str, Any] = {A.DUPLICATE_OF: prior.trial_number}
    previous = opt.get_trial(study, prior.trial_number)
    if prior.quarantined:
        # Copying an admin-quarantined measurement would bring it back under a new number.
        message = f"duplicate of trial {prior.trial_number}, which an admin quarantined: its result is not reused"
        opt.tell_failed(study, asked.number, {**attrs, A.FAILURE_KIND: "quarantined", A.FAILURE_MESSAGE: message})
    elif prior.state == ConfigState.DONE and previous.value is not None:
        violation = previous.constraints.get(CONSTRAINT_KEY, 0.0)
        opt.tell_value(study, asked.number, previous.value, violation, {**previous.user_attrs, **attrs})
    elif prior.state == ConfigState.INFEASIBLE:
        opt.tell_infeasible(study, asked.number, attrs)
    elif prior.state == ConfigState.PRUNED:
        opt.tell_pruned(study, asked.number, attrs)
    else:
        opt.tell_failed(
            study,
            asked.number,
            {**attrs, A.FAILURE_KIND: "duplicate", A.FAILURE_MESSAGE: "duplicate of a configuration in flight"},
        )


def tell_measured(
    study: optuna.Study,
    spec: StudySpec,
    number: int,
    levels: Sequence[Mapping[str, Any]],
    base: Mapping[int, float],
    attrs: dict[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> tuple[ConfigState, float | None]:
    """A trial's measured levels told against its host's baseline (`base`: output tok/s per level;
    `attrs[A.BASELINE_LEVELS]`: its levels as reported); `extra`: attributes kept with the trial.
    Returns the configuration's state and the value told (None when pruned).  A trial already
    finished (a retry got there first) keeps the report in the store's own record only."""
    measured = {int(lv["concurrency"]): base[int(lv["concurrency"])] for lv in levels if int(lv["concurrency"]) in base}
    level_docs = [dict(lv) for lv in levels]
    common = {
        A.BASELINE_TOK_S: {str(k): v for k, v in measured.items()},
        A.LEVELS: level_docs,
        **(extra or {}),
    }
    try:
        if {int(lv["concurrency"]) for lv in levels} < set(spec.workload.concurrency):
            # Stopped early (pruned): a partial workload must not pose as a measured value.
            partial = {str(c): float(lv["output_tok_s"]) / measured[c] for lv in levels
                       if (c := int(lv["concurrency"])) in measured}  # fmt: skip
            opt.tell_pruned(study, number, attrs | common | {A.PARTIAL_SPEEDUP_BY_LEVEL: partial})
            return ConfigState.PRUNED, None
        # By the objective's figure, against the same host's baseline levels (its passes too).
        base_levels = [lv for lv in attrs.get(A.BASELINE_LEVELS) or [] if int(lv["concurrency"]) in measured]
        sc = score_levels(spec.objective, level_docs, base_levels)
        attrs = attrs | common | {A.SPEEDUP_BY_LEVEL: {str(k): v for k, v in sc.speedups.items()}}
        opt.tell_value(study, number, sc.value, sc.violation, attrs)
        return ConfigState.DONE, sc.value
    except TrialStateError:
        return ConfigState.DONE, None


def tell_failure(
    study: optuna.Study,
    number: int,
    kind: str,
    message: str,
    attrs: dict[str, Any],
    *,
    host_fault: bool = False,
    log_tail: str = "",
) -> ConfigState | None:
    """A launch that failed: infeasible when the configuration is to blame (CONFIG_FAILURES, and
    not the host's fault), told so; None when it is to be retried (nothing told)."""
    attrs = attrs | {A.FAILURE_KIND: kind, A.FAILURE_MESSAGE: message[:2000]}
    if kind in CONFIG_FAILURES and not host_fault:
        try:
            opt.tell_infeasible(study, number, attrs | {A.LOG_TAIL: log_tail[-4000:]})
        except TrialStateError:
            return ConfigState.DONE  # already told (a retry finished first)
        return ConfigState.INFEASIBLE
    return None


def retry_or_give_up(
    store: StudyStore, lease: LeaseRecord, now: datetime, kind: str, message: str, max_attempts: int
) -> GiveUp | None:
    """Queue the trial again (a new lease, attempt + 1), or give it up after `max_attempts`.

    Giving up keeps what the attempts learnt: the last failure's kind and message, and the levels
    any attempt measured before it was interrupted.  The FAIL is the caller's to tell (`tell_given_up`).
    """
    assert lease.trial_number is not None
    if lease.attempt < max_attempts:
        store.queue_retry(lease, now)
        store.event("trial_requeued", lease, f"{kind}: {message}; attempt {lease.attempt + 1} queued")
        return None
    store.set_config_state(lease.config_key, ConfigState.FAILED)
    attrs: dict[str, Any] = {
        A.FAILURE_KIND: kind,
        A.FAILURE_MESSAGE: f"{message[:1800]} (gave up after {lease.attempt} attempts)",
        A.CONFIG: None if lease.config is None else lease.config.model_dump(mode="json"),
        A.CONFIG_KEY: lease.config_key,
    }
    levels = store.levels_measured(lease.trial_number)
    if levels:
        attrs[A.LEVELS_MEASURED] = levels
    return GiveUp(store.spec, lease.trial_number, attrs)


def tell_given_up(study: optuna.Study, give_up: GiveUp) -> None:
    try:
        opt.tell_failed(study, give_up.number, give_up.attrs)
    except TrialStateError:
        log.info("trial %d of %s already finished; nothing to fail", give_up.number, give_up.spec.name)


# ------------------------------------------------------------------------------ confirmations


def queue_confirmations(
    store: ConfirmQueue, candidates: Sequence[Candidate], now: datetime, *, adaptive_proof: bool = True
) -> None:
    """One queued confirmation per candidate of a StartConfirmation or Reconfirm, each to launch
    its deployment as printed.  `adaptive_proof` False: the hosts launch static servers only (the
    rehearsal's), and the adaptive proof is not queued."""
    for cand in candidates:
        if cand.adaptive and not adaptive_proof:
            continue
        # Each candidate is confirmed as it would be deployed: the winner's confirmation is then
        # the launch that proves the printed command (issue 17 item 1), no launch added.  Without
        # an envelope left (the conductor found none) it is queued in the first, and the claim
        # ends it unlaunched (claim_confirm).
        env = cand.envelope or deploy.deployment_envelopes(store.spec, cand.config)[0]
        if cand.adaptive:
            # The adaptive proof has no tier: if it does not start, the next smaller graph envelope
            # of its own server is tried (next_adaptive_envelope), and when none is left the answer
            # falls back to what the other confirmations proved (api.services.studies).  Its own
            # key: it is not a re-launch of its initial chain (the launch-noise groups).
            info, key = ConfirmInfo(tier=None, adaptive=True), deploy.ADAPTIVE_KEY
        else:
            info = ConfirmInfo(
                tier=cand.tier,
                envelope_note=env.note,
                avoid_worker=cand.avoid_worker,
                search_speedup=cand.search_speedup,
            )
            key = cand.config.key
        store.queue_confirm(QueuedConfirm(cand.trial_number, cand.config, key, info, env), now)


def _label(lease: LeaseRecord) -> str:
    cfg = lease.config
    return "" if cfg is None else f"{cfg.num_steps}/{cfg.topk}/{cfg.num_draft_tokens}"


def claim_confirm(
    store: StudyStore, lease: LeaseRecord, action: Confirm, now: datetime, trials: Sequence[FrozenTrial] = ()
) -> bool:
    """The conductor's `Confirm` on a queued confirmation: the deployment the conductor names, or
    what the study's deployments taught since it was queued (skip an envelope known to fail).
    False: every envelope left is known to run out of memory, and the candidate is out, unlaunched."""
    due = None
    if lease.config is not None and lease.tier is not None:
        # The conductor's deployment (one launch at a time in an envelope nothing started in);
        # without one, what the study's failures leave.
        due = action.deployment or next_deployment(
            store.spec, lease.config, store.deploy_failures(), lease.tier - 1, trials, store.policy
        )
        if due is None:
            # Launching the queued one would only repeat a known failure.
            store.end_lease(lease, "failed", now)
            store.event(
                DEPLOY_FAILED,
                lease,
                f"{_label(lease)} was not launched: a configuration needing no more graph memory ran out of memory "
                "in every graph envelope the serving section leaves; it cannot be the answer",
            )
            return False
    store.claim_confirm(lease, action, now, due)
    return True


def confirm_failed(
    store: StudyStore,
    lease: LeaseRecord,
    now: datetime,
    kind: str,
    message: str,
    *,
    host_fault: bool,
    max_attempts: int,
    trials: Sequence[FrozenTrial] = (),
) -> None:
    """A confirmation's launch failed: the host's fault (or not the configuration's), retried; a
    start that ran out of memory or timed out, the next envelope; otherwise it is out (stated)."""
    reason = f"{kind}: {message}"
    adaptive = lease.confirm is not None and lease.confirm.adaptive
    if host_fault or kind not in CONFIG_FAILURES:
        retry_confirm(store, lease, now, reason, max_attempts)
    elif kind in START_FAILURES and lease.tier is not None:
        next_envelope(store, lease, now, kind, message, trials)
    elif adaptive:
        next_adaptive_envelope(store, lease, now, kind, message)
    else:
        store.event("confirm_failed", lease, reason)


def next_envelope(
    store: StudyStore, lease: LeaseRecord, now: datetime, kind: str, message: str, trials: Sequence[FrozenTrial] = ()
) -> None:
    """The deployment did not start: the same configuration in the next smaller graph envelope the
    serving section allows, or, when none is left, the candidate is out (stated)."""
    assert lease.config is not None and lease.tier is not None and lease.confirm is not None
    why = deploy.deployment_failure(kind, message)
    due = next_deployment(store.spec, lease.config, store.deploy_failures(), lease.tier, trials, store.policy)
    if due is None:
        store.event(
            DEPLOY_FAILED,
            lease,
            f"{_label(lease)} did not start as it would be deployed ({why}), and the serving envelope leaves no "
            "smaller graph envelope to try: it cannot be the answer",
        )
        return
    tier, env = due
    info = dataclasses.replace(lease.confirm.unpaired(), tier=tier, envelope_note=env.note)
    store.requeue_confirm(lease, now, info, env.settings)
    store.event(
        DEPLOY_RETRY, lease, f"{_label(lease)} did not start as it would be deployed ({why}); trying {env.note}"
    )


def next_adaptive_envelope(store: StudyStore, lease: LeaseRecord, now: datetime, kind: str, message: str) -> None:
    """The adaptive server did not start: out of memory or a time-out (graph capture), the same
    server with smaller CUDA graphs where the serving envelope allows; anything else, or nothing
    smaller left, and the answer falls back to what was proven (api.services.studies)."""
    assert lease.confirm is not None
    why = deploy.deployment_failure(kind, message)
    smaller = (
        deploy.smaller_envelope(store.spec, lease.server)
        if kind in START_FAILURES and lease.server is not None
        else None
    )
    if smaller is None:
        store.event(deploy.ADAPTIVE_FAILED, lease, f"the adaptive deployment did not start ({why}: {message[:300]})")
        return
    info = dataclasses.replace(lease.confirm.unpaired(), envelope_note=smaller.note)
    store.requeue_confirm(lease, now, info, smaller.settings)
    store.event(DEPLOY_RETRY, lease, f"the adaptive deployment did not start as printed ({why}); trying {smaller.note}")


def retry_confirm(store: StudyStore, lease: LeaseRecord, now: datetime, reason: str, max_attempts: int) -> None:
    """Queue a confirmation again (its baseline pairing is redone), up to `max_attempts`."""
    assert lease.confirm is not None
    if lease.attempt >= max_attempts:
        store.event("confirm_given_up", lease, f"{reason}; gave up after {lease.attempt} attempts")
        if lease.confirm.adaptive:
            store.event(
                deploy.ADAPTIVE_FAILED,
                lease,
                f"the adaptive deployment was not measured: {reason}; gave up after {lease.attempt} attempts",
            )
        return
    store.requeue_confirm(lease, now, lease.confirm.unpaired(), None)  # the same server as queued
    store.event("confirm_requeued", lease, f"{reason}; attempt {lease.attempt + 1} queued")
