"""The search phase: the stop rule's one seam (`stop_rule`), what a worker asking in the search is
told, the confirmation's baseline measured while the last launches fly, and why the search ends."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from optimizer import attrs as A
from optimizer import believer, convergence, stop_rules
from optimizer.budget import budget_used
from optimizer.conductor.confirming import candidates
from optimizer.conductor.orders import Action, Ask, MeasureBaseline, Wait
from optimizer.conductor.snapshot import Snapshot
from optimizer.infeasible import known_to_fail, oom_points
from optimizer.memo import PerStudyMemo
from optimizer.model_sampler import space_configs
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.spec import StudySpec
from optimizer.study import best_trial_of, is_feasible
from optimizer.study_state import Ending, FinishReason
from optimizer.verify_probe import VerifyShape, shapes_key

# The search's thresholds are the snapshot's policy (optimizer.policy: model_parallel,
# belief_margin, and the stop rule's); these names are the default policy's values, for callers
# outside the conductor.
# model_parallel: search launches in flight at once after the model's first `min_measured` results
# (before, the fleet launches the starting points the model still needs, at least this many at a
# time).  Each proposal comes from one fit, spread away from the launches in flight; a third and a
# fourth from the same fit mostly answer what the first two will.
MODEL_PARALLEL = DEFAULT_POLICY.model_parallel
BELIEF_MARGIN = DEFAULT_POLICY.belief_margin

# The last assessment per study, with the spec, the finished trials and the launches in flight it
# saw (a configuration in flight is not open): the model is refit after a new result or launch,
# not at every lease.  A memo of a pure function (any process recomputes it), bounded.
_ASSESSED: PerStudyMemo[convergence.Assessment] = PerStudyMemo(256)
# The stop rule with the launches in flight believed at the model's predictions (`believed_settles`;
# None: nothing in flight to believe).
_BELIEVED: PerStudyMemo[convergence.Assessment | None] = PerStudyMemo(256)


def converges(spec: StudySpec) -> bool:
    """The convergence stop asks the `auto` sampler's model; other samplers run to their caps."""
    return spec.budget.converge and spec.sampler == "auto"


def stop_rule(
    spec: StudySpec,
    trials: Sequence[FrozenTrial],
    policy: Policy = DEFAULT_POLICY,
    shapes: Mapping[str, VerifyShape] | None = None,
) -> convergence.Assessment | None:
    """Is the answer known?  `optimizer.convergence.assess` (the one seam to the stop rule), or
    None when the study does not converge.  `shapes`: the hosts' probed verify cost
    (`Snapshot.verify_shapes`).  Memoised on the trials it would see."""
    if not converges(spec):
        return None
    return _ASSESSED.get(
        spec.name,
        _rule_inputs(spec, trials, policy, shapes),
        lambda: convergence.assess(spec, list(trials), policy, shapes),
    )


def _rule_inputs(
    spec: StudySpec, trials: Sequence[FrozenTrial], policy: Policy, shapes: Mapping[str, VerifyShape] | None = None
) -> tuple[Any, ...]:
    """What the stop rule sees, as a memo key: the spec and the policy too (two studies of one name,
    a benchmark's seeds and variants, never share an answer), the probed shapes (a new baseline's
    probe changes the fit), and the launches in flight."""
    return (
        spec.model_dump_json(),
        policy,
        shapes_key(shapes),
        *(
            (t.number, t.state, t.value, t.user_attrs.get(A.CONFIG_KEY))
            for t in trials
            if t.state.is_finished() or t.state == TrialState.RUNNING
        ),
    )


def searching(snap: Snapshot, worker_id: str, spare: bool) -> Action | None:
    """What `worker_id` does while the search goes on: `Ask` for a configuration, or wait for the
    launches in flight (`parallel_cap`, `in_flight_settles`), measuring the confirmation's baseline
    meanwhile where it may (`ready_baseline`).  None: the search is over (`search_over`)."""
    if search_over(snap) is not None:
        return None
    capped = parallel_cap(snap)
    if capped is not None and not _may_ready(snap, worker_id):
        return Wait(capped)  # the believer's fit behind `in_flight_settles` would change nothing
    settling = in_flight_settles(snap)
    if settling is None:
        return Ask() if capped is None else Wait(capped)
    return spare_or_wait(snap, worker_id, Wait(capped or settling), spare)


def spare_or_wait(snap: Snapshot, worker_id: str, wait: Wait, spare: bool) -> Action:
    """`wait`, or the confirmation's baseline this worker may measure meanwhile (`ready_baseline`):
    given when the worker is `spare` (no other study has work for it), else said in the Wait."""
    ready = ready_baseline(snap, worker_id)
    if ready is None:
        return wait
    return ready if spare else dataclasses.replace(wait, spare_baseline=True)


def search_over(snap: Snapshot) -> str | None:
    """Why no new configuration is asked for (the budget, or the stop rule settled), else None."""
    spent = budget_used(snap.spec.budget, len(snap.launched), snap.now - snap.created_at)
    if spent is not None:
        return spent
    a = stop_rule(snap.spec, snap.trials, snap.policy, snap.verify_shapes())
    return a.reason if a is not None and a.settled else None


def launches_needed(
    spec: StudySpec, trials: Sequence[FrozenTrial], a: convergence.Assessment | None, policy: Policy = DEFAULT_POLICY
) -> int | None:
    """The fewest further launches that settle the stop rule if none of them beats the incumbent
    (None: the rule cannot say, e.g. the model still sees a configuration likely to beat it).

    Read off the rule's own terms (optimizer.convergence, optimizer.stop_rules): the model's
    `min_measured`; once the model is trusted and sees nothing likely to win, the one launch the
    rule still waits for (the depth probe: `assess` settles otherwise); with a distrusted model
    the empirical rule's quiet spell; whatever the model says, the improvement-rate backstop.
    """
    if a is None or a.settled:
        return None
    if a.measured < policy.min_measured:
        return policy.min_measured - a.measured
    if a.open_configs < 0:  # not a question more launches answer (a wide incumbent, no confirmation)
        return None
    lead = stop_rules.lead(stop_rules.launches(trials), spec.budget.min_gain, policy)
    needs = [stop_rules.stall_needed(lead.found_at, policy) - lead.since]
    trusted = a.check is not None and a.check.trusted  # no check: no model
    if trusted and a.best_chance < policy.p_matters:
        needs.append(1)  # unsettled here only while it waits for the depth probe: one launch
    elif not trusted:
        needs.append(stop_rules.hold_needed(lead.found_at, policy) - a.quiet)
    return max(1, min(needs))


def parallel_cap(snap: Snapshot) -> str | None:
    """Why a worker asking in the search is told to wait: `policy.model_parallel` of the model's
    proposals are in flight already (None: fewer, or the model has not its first results yet)."""
    flying = len(snap.in_flight)
    if flying < snap.policy.model_parallel:
        return None
    a = stop_rule(snap.spec, snap.trials, snap.policy, snap.verify_shapes())
    if a is not None and a.measured >= snap.policy.min_measured:
        return f"{flying} of the model's proposals are in flight (at most {snap.policy.model_parallel} at once)"
    return None


def in_flight_settles(snap: Snapshot) -> str | None:
    """Why a worker asking in the search is told to wait: the search launches already in flight
    are as many as the stop rule still needs (`launches_needed`), or settle the model rule if they
    come in as it predicts them (`believed_settles`), so one more would be spent on a question
    they answer.  If one of them beats the incumbent, the rule needs more and the next worker
    asks.  Without this, a fleet of four overshoots a settled rule by up to three launches.
    """
    flying = len(snap.in_flight)
    if flying == 0:
        return None
    a = stop_rule(snap.spec, snap.trials, snap.policy, snap.verify_shapes())
    if a is not None and not a.settled and a.measured >= snap.policy.min_measured and a.model_trusted and not a.walking:
        held = believed_settles(snap)
        if held is not None:
            return held
    needed = launches_needed(snap.spec, snap.trials, a, snap.policy)
    if needed is None or a is None:
        return None
    if a.measured < snap.policy.min_measured:
        # The starting points fly `model_parallel` at a time at least, as on two workers: holding the
        # last one back until the first results are in changed which points were launched, and on
        # zigzag-tiles cost answers (2 workers: 15/20 within 2% -> 7/20).
        needed = max(needed, snap.policy.model_parallel)
    if a.walking:
        # The empirical rule's spell counts only the walk around the incumbent, so only a walk in
        # flight answers it (where the improvement-rate backstop would settle first, counting
        # every launch, this asks for one launch more than it needs: never a wait for nothing).
        lead = stop_rules.lead(stop_rules.launches(snap.trials), snap.spec.budget.min_gain, snap.policy)
        flying = stop_rules.walks_in_flight(snap.trials, lead)
    if flying < needed:
        return None
    return (
        f"the {flying} launch(es) in flight are what the stop rule still needs ({needed}); "
        "asking again if one of them beats the incumbent"
    )


def ready_baseline(snap: Snapshot, worker_id: str) -> MeasureBaseline | None:
    """The confirmation's baseline, measured by a host the search leaves idle while the launches in
    flight are expected to end it (or end it after the rule settled); None: wait.

    A confirmation pairs with a baseline its host measured at most `Timing.confirm_idle_s` before
    (`baseline_serves`, `baseline_fresh`), so one measured now serves it and the confirmation
    starts when the last result is in, not a baseline later.  Only one for each set of launches
    in flight (if a result reopens the search, the next set may have another: a wrong guess costs
    one baseline, which then serves this host's own launches), only while no host that may take
    the candidates holds one that fresh, only on a host that found none of the candidates the
    confirmation would take now (each is confirmed away from its finder), and only when the
    answer is speculation (a study that ends "does not pay" confirms nothing).
    """
    if not _may_ready(snap, worker_id):
        return None
    chosen = candidates(snap)
    if not chosen or any(c.avoid_worker == worker_id for c in chosen):
        return None
    finders = {c.avoid_worker for c in chosen}
    window = timedelta(seconds=snap.timing.confirm_idle_s)
    for h in snap.live_hosts():
        b = snap.latest_baseline(h.id)
        if h.id not in finders and b is not None and snap.now - b.measured_at <= window:
            return None
    return MeasureBaseline(worker_id, for_confirmation=True)


def _may_ready(snap: Snapshot, worker_id: str) -> bool:
    """`ready_baseline`'s cheap conditions (the stop rule's fit is memoised): the model has its first
    results and the rule does not say "does not pay", launches in flight, no
    baseline measured or measuring since the newest of them began, and a launch beating the
    baseline (as it stands the study would not end "does not pay")."""
    if not converges(snap.spec):
        return False
    a = stop_rule(snap.spec, snap.trials, snap.policy, snap.verify_shapes())
    if a is None or a.measured < snap.policy.min_measured or a.pays is False:
        return False
    flying = snap.in_flight
    if not flying or any(le.kind == "baseline" and le.live for le in snap.leases):
        return False
    newest = max((le.leased_at or le.created_at or snap.now for le in flying), default=snap.now)
    if any(b.measured_at >= newest for b in snap.baselines):
        return False
    best = best_trial_of(snap.trials)
    return best is not None and best.value is not None and best.value > 1.0


def believed_settles(snap: Snapshot) -> str | None:
    """Why to wait when the model, trusted, would settle the stop rule once the launches in flight
    come in as it predicted them (optimizer.believer), with `policy.belief_margin` of its bar to spare;
    None otherwise.  Memoised on what the rule sees and which host runs each launch in flight."""
    hosts = {le.trial_number: le.worker_id for le in snap.in_flight if le.worker_id and le.trial_number is not None}
    shapes = snap.verify_shapes()
    seen = (tuple(sorted(hosts.items())), *_rule_inputs(snap.spec, snap.trials, snap.policy, shapes))

    def assess() -> convergence.Assessment | None:
        trials = believer.believed(snap.spec, snap.trials, snap.now, hosts, shapes, snap.policy)
        return None if trials is None else convergence.assess(snap.spec, trials, snap.policy, shapes)

    a = _BELIEVED.get(snap.spec.name, seen, assess)
    if a is None or not a.settled or a.rule != stop_rules.StopRule.MODEL:
        return None
    if a.best_chance >= snap.policy.belief_margin * snap.policy.p_matters:
        return None
    return (
        "the launches in flight settle the stop rule if they come in as the model predicts; "
        "asking again if a result leaves it open"
    )


def search_ending(snap: Snapshot, assessment: convergence.Assessment | None) -> Ending | None:
    """Why the search ends now (the budget, an exhausted space, the stop rule, patience), or None."""
    spec = snap.spec
    if len(snap.launched) >= spec.budget.max_trials:
        return Ending(FinishReason.MAX_TRIALS, f"max_trials={spec.budget.max_trials} configurations measured")
    spent = budget_used(spec.budget, len(snap.launched), snap.now - snap.created_at)
    if spent is not None:
        return Ending(FinishReason.MAX_HOURS, spent)
    if space_exhausted(snap):
        return Ending(
            FinishReason.SPACE_EXHAUSTED,
            "every valid configuration in the search space was measured or is known to run out of memory",
        )
    if assessment is not None and assessment.settled:
        pays = assessment.pays is not False
        return Ending(FinishReason.CONVERGED if pays else FinishReason.DOES_NOT_PAY, assessment.reason)
    if spec.budget.patience is not None:
        why = patience_reason(spec, snap.trials)
        if why is not None:
            return Ending(FinishReason.PATIENCE, why)
    return None


def space_exhausted(snap: Snapshot) -> bool:
    """Is every configuration of the space launched already, or known to fail (optimizer.infeasible)?"""
    if len(snap.launched) >= snap.spec.search_space.count_configs():
        return True
    ooms = oom_points(list(snap.trials))
    if not ooms:  # nothing is known to fail, so an unlaunched configuration is left: no need to build the space
        return False
    configs = space_configs(snap.spec.search_space)
    return all(c.key in snap.launched or known_to_fail(c, ooms) is not None for c in configs)


def patience_reason(spec: StudySpec, trials: Sequence[FrozenTrial]) -> str | None:
    """Patience counts measured trials (not duplicates answered from earlier ones) since the best."""
    assert spec.budget.patience is not None
    best_value: float | None = None
    since_best = 0
    states = (TrialState.COMPLETE, TrialState.PRUNED)
    for t in sorted((t for t in trials if t.state in states), key=lambda t: t.number):
        if not A.TrialRecord(t).launched:
            continue
        if (
            t.state == TrialState.COMPLETE
            and t.value is not None
            and is_feasible(t)
            and (best_value is None or t.value > best_value)
        ):
            best_value, since_best = t.value, 0
        else:
            since_best += 1
    if best_value is not None and since_best >= spec.budget.patience:
        return f"patience={spec.budget.patience}: no improvement in the last {since_best} trials"
    return None


def unleased_running(snap: Snapshot) -> bool:
    """Does the sampler hold a RUNNING trial that no lease will finish (an ask whose lease was lost)?

    The lease service fails such a trial after `orphan_grace_s`; until then the study must not
    finish around it.
    """
    held = {le.trial_number for le in snap.in_flight}
    return any(t.state == TrialState.RUNNING and t.number not in held for t in snap.trials)
