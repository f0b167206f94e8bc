"""Where a confirmation deploys: the envelope a queued confirmation launches in, past the ones
its study's out-of-memory starts and the memory model (optimizer.memory_boundary) rule out, and
which queued confirmations may launch at once (one at a time in an envelope nothing of the study
started in yet)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from optuna.trial import FrozenTrial

from optimizer import deploy
from optimizer.conductor.snapshot import LeaseView, Snapshot
from optimizer.memory_boundary import MemoryBoundary, Terms, capture_list, tuning_launches
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec


def next_deployment(
    spec: StudySpec,
    config: SpecConfig,
    failed: Sequence[tuple[SpecConfig, int]] = (),
    after: int = -1,
    trials: Sequence[FrozenTrial] = (),
    policy: Policy = DEFAULT_POLICY,
) -> tuple[int, deploy.Envelope] | None:
    """The deployment a confirmation of `config` launches: the first envelope past tier `after`
    that no earlier out-of-memory start rules out, nor the memory model learnt from them and the
    search's `trials` says surely fails under the study's `policy` (optimizer.deploy.envelopes_to_try),
    or None when none is left (the candidate cannot be the answer)."""
    options = deploy.envelopes_to_try(spec, config, failed, trials, policy)
    return next(((t, e) for t, e in options if t > after), None)


EnvelopeKey = tuple[int, tuple[int, ...]]


def envelope_key(settings: ServerSettings) -> EnvelopeKey:
    """What makes two deployments one envelope for starting: the load served and the graphs captured."""
    return settings.max_running_requests, capture_list(settings)


def _started_envelopes(snap: Snapshot) -> set[EnvelopeKey]:
    """Envelopes a confirmation of this study started in (it completed: its server came up)."""
    return {
        envelope_key(le.server) for le in snap.leases if le.kind == "confirm" and le.state == "completed" and le.server
    }


def deployment_for(snap: Snapshot, lease: LeaseView) -> tuple[int, deploy.Envelope] | None:
    """The deployment a queued confirmation launches now: `next_deployment` from its tier, and
    past an envelope that no confirmation of this study started in yet but one ran out of memory
    in, where the memory model (optimizer.memory_boundary, learnt from the search and those
    failures) says this candidate more likely than not fails there too (`policy.probable_failure`,
    the bar a search launch must pass): until something started in it, the printed envelope is
    unproven, and a second out-of-memory start there would be a launch spent on a likely failure.
    A candidate the model gives an even chance or better is tried there (it may prove the printed
    command); the last envelope left is always tried.  None: no envelope is left."""
    assert lease.config is not None and lease.tier is not None
    spec, cfg = snap.spec, lease.config
    failed = deploy_failures(snap.leases)
    options = [
        (t, e) for t, e in deploy.envelopes_to_try(spec, cfg, failed, snap.trials, snap.policy) if t >= lease.tier
    ]
    started = _started_envelopes(snap)
    failed_in = {envelope_key(le.server) for le in snap.leases if le.failure == "oom" and le.server is not None}
    boundary: MemoryBoundary | None = None
    skipped: list[str] = []
    while len(options) > 1:
        tier, env = options[0]
        key = envelope_key(env.settings)
        if key in started or key not in failed_in:
            break
        if boundary is None:
            boundary = MemoryBoundary.fit(
                [*tuning_launches(spec, snap.trials), *deploy.deployment_launches(spec, failed)], snap.policy
            )
        if boundary is None:
            break
        terms = Terms.of(env.settings, cfg)
        j = boundary.judge(terms)
        if j.p_fail < snap.policy.probable_failure:
            break
        what = env.note.split(":")[0] if env.note else f"the printed envelope ({terms.describe()})"
        skipped.append(
            f"{what} was not launched (no deployment of this study started there; {j.p_fail:.0%} likely "
            f"to run out of memory: {j.reason})"
        )
        options.pop(0)
    if not options:
        return None
    tier, env = options[0]
    if skipped:
        env = deploy.Envelope(env.settings, "; ".join([env.note, *skipped]))
    return tier, env


def _launch_envelope(
    snap: Snapshot, lease: LeaseView, ran: Sequence[Terms]
) -> tuple[tuple[int, deploy.Envelope] | None, EnvelopeKey | None]:
    """A queued confirmation's deployment (`deployment_for`), and the envelope it starts in when
    that still needs proof: None when the memory model (optimizer.memory_boundary) says it needs
    no more graph memory than a launch of the search that started (`ran`), as where the printed
    envelope is the tuning one."""
    if lease.config is None or lease.tier is None:
        due, settings = None, lease.server
    else:
        due = deployment_for(snap, lease)
        settings = None if due is None else due[1].settings
    cfg = lease.config or (None if settings is None else settings.speculative)
    if settings is None or cfg is None:
        return due, None
    terms = Terms.of(settings, cfg)
    return due, None if any(r.covers(terms) for r in ran) else envelope_key(settings)


@dataclass(frozen=True)
class Launchable:
    """The queued confirmations that may launch now, and in which deployment."""

    ready: list[LeaseView]
    due: dict[str, tuple[int, deploy.Envelope] | None]  # by lease id: its deployment (`deployment_for`)
    untested: dict[str, EnvelopeKey]  # by lease id: an envelope no confirmation of the study started in

    def one_per_envelope(self, mine: Sequence[LeaseView]) -> list[LeaseView]:
        """`ready` with one confirmation per untested envelope (this host's, where it may take one
        of `mine`): no baseline is measured for the others."""
        first: dict[EnvelopeKey, LeaseView] = {}
        takes = {le.id for le in mine}
        for le in sorted(self.ready, key=lambda le: le.id not in takes):
            if le.id in self.untested:
                first.setdefault(self.untested[le.id], le)
        return [le for le in self.ready if le.id not in self.untested or first[self.untested[le.id]] is le]


def launchable(snap: Snapshot, queued: Sequence[LeaseView]) -> Launchable:
    """An envelope no confirmation of this study started in yet takes one launch at a time: if it
    runs out of memory, the others learn from it (`deployment_for`) instead of dying beside it.
    Once one started there, the rest go in parallel; other hosts meanwhile take confirmations in
    envelopes already proven, or wait."""
    started = _started_envelopes(snap)
    trying = {
        envelope_key(le.server)
        for le in snap.leases
        if le.kind == "confirm" and le.state == "active" and le.server is not None
    } - started
    ran = [x.terms for x in tuning_launches(snap.spec, snap.trials) if x.started]
    due: dict[str, tuple[int, deploy.Envelope] | None] = {}
    untested: dict[str, EnvelopeKey] = {}
    ready = []
    for le in queued:
        due[le.id], key = _launch_envelope(snap, le, ran)
        if key is not None and key not in started:
            if key in trying:
                continue
            untested[le.id] = key
        ready.append(le)
    return Launchable(ready, due, untested)


def deploy_failures(leases: Iterable[LeaseView]) -> list[tuple[SpecConfig, int]]:
    """(configuration, tier) of the confirmations among `leases` that ran out of memory at start-up:
    what the next deployment envelope is chosen past (optimizer.deploy.envelopes_to_try)."""
    return [
        (le.config, le.tier)
        for le in leases
        if le.kind == "confirm" and le.state == "failed" and le.failure == "oom" and le.config and le.tier is not None
    ]
