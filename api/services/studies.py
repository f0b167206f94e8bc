"""Studies: create, list, show (with the answer a user wants), stop, and finishing rules."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.artifacts import paths_to_names
from api.context import ServiceContext
from api.db import db_now
from api.errors import ConflictError, LimitReachedError
from api.models import BaselineRow, LeaseRow, StudyRow, TrialConfigRow, WorkerRow
from api.optuna_tables import empty_counts, trial_counts
from api.services import eligibility as elig
from api.services import trial_records
from api.services.leasing.records import active_refusals, lease_payload, new_lease_row
from api.services.leasing.states import LeaseKind
from optimizer import answers, convergence, costs, deploy
from optimizer import attrs as A
from optimizer import confirmation as confirm
from optimizer import study as opt
from optimizer.analysis import Interval, LaunchNoise, level_intervals
from optimizer.budget import budget_used
from optimizer.errors import StudyNotFoundError
from optimizer.infeasible import known_to_fail, oom_points
from optimizer.model_sampler import space_configs
from optimizer.plan import baseline_key
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec, describe_workload, validate_spec

log = logging.getLogger("spectune.api.studies")

# The SGLang version a command is written for when a trial did not record the one it ran on.
DEFAULT_SGLANG_VERSION = "0.5.23"


def spec_of(s: Session, name: str) -> StudySpec:
    row = s.get(StudyRow, name)
    if row is None:
        raise StudyNotFoundError(name)
    return stored_spec(row)


def stored_spec(row: StudyRow) -> StudySpec:
    """The stored spec; ConflictError (not a 500) when it fails today's checks.

    Only a study stored by an older version can: `spectune db upgrade` stops those (migration
    0003), and a new spec that fails is refused at creation.
    """
    try:
        return StudySpec.model_validate(row.spec)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConflictError(
            f"study {row.name!r} was stored by an older version and its spec fails this version's checks "
            f"({where}: {first['msg']}); stop it and create it again with a corrected spec",
            field=where,
        ) from None


def runnable_spec(row: StudyRow) -> StudySpec | None:
    """A stored study's spec, or None (logged) when it no longer passes today's checks.

    A study stored before a check existed (e.g. `max_hours: 1e300`, refused since) must not break
    leasing or warm starts for every other study: they pass it by (`spectune db upgrade` stops it).
    """
    try:
        return StudySpec.model_validate(row.spec)
    except ValidationError as e:
        log.warning("study %s is passed by: its stored spec fails today's checks (%s); stop it", row.name, e)
        return None


def baseline_key_of(spec: StudySpec) -> str:
    return baseline_key(spec)


def confirming(s: Session, name: str) -> bool:
    """Has the study begun confirming its candidates (it then asks for no new configuration)?"""
    found = s.scalars(
        select(LeaseRow.id).where(LeaseRow.study_name == name, LeaseRow.kind == "confirm").limit(1)
    ).first()
    return found is not None


def study_trials(storage: optuna.storages.BaseStorage, name: str) -> list[FrozenTrial]:
    """Every trial of a study, read from Optuna's storage for `maybe_finish`.

    Read before our write transaction opens: on SQLite, calling Optuna while we hold the write
    lock would wait for ourselves (api/db.py install_sqlite_transactions).
    """
    # Screened: a stored value that fails today's checks can never make a reader raise.
    return trial_records.screened(storage.get_all_trials(storage.get_study_id_from_name(name), deepcopy=False))


def maybe_finish(s: Session, spec: StudySpec, now: datetime, trials: Sequence[FrozenTrial]) -> None:
    """Once the budget is used and nothing is in flight: confirm the top candidates, then finish.

    `trials` comes from `study_trials`, read before `s` began.  The study stays `running` while
    its confirmations run, and moves to `finished` only when every confirmation is done or given up.
    """
    row = s.get(StudyRow, spec.name, with_for_update=True)
    if row is None or row.state != "running":
        return
    assessment = assess_convergence(spec, trials) if not confirming(s, spec.name) else None
    pending = s.scalar(
        select(func.count())
        .select_from(LeaseRow)
        .where(LeaseRow.study_name == spec.name, LeaseRow.kind != "baseline", LeaseRow.state.in_(("queued", "active")))
    )
    if pending or _unleased_running(s, spec, trials):
        return
    if confirming(s, spec.name):
        done = s.scalar(
            select(func.count())
            .select_from(LeaseRow)
            .where(LeaseRow.study_name == spec.name, LeaseRow.kind == "confirm", LeaseRow.state == "completed")
        )
        why = (row.finish_reason or "budget used").removesuffix(CONFIRMING_SUFFIX)
        _finish(row, now, f"{why}; {done or 0} confirmed")
        return
    reason = budget_used(spec.budget, launched_count(s, spec.name), now - row.created_at)
    if reason is None and space_exhausted(s, spec, trials):
        reason = "every valid configuration in the search space was measured or is known to run out of memory"
    if reason is None and assessment is not None and assessment.settled:
        reason = assessment.reason
    if reason is None and spec.budget.patience is not None:
        reason = _patience_reason(spec, trials)
    if reason is None:
        return
    if assessment is not None and reason == assessment.reason and assessment.pays is False:
        # Nothing is likely to reach 1.0x: confirming a loser costs restarts and changes nothing.
        _finish(row, now, reason)
        return
    if start_confirmation(s, spec, now, trials):
        row.finish_reason = f"{reason}{CONFIRMING_SUFFIX}"[:256]
        log.info("study %s: %s; confirming", spec.name, reason)
        return
    _finish(row, now, reason)


# While its confirmations run, a study's finish_reason ends with this; it is dropped on finishing.
CONFIRMING_SUFFIX = "; confirming the best candidates against fresh baselines"


def launched_count(s: Session, study: str) -> int:
    """Configurations launched so far in a study (what the budget counts)."""
    return s.scalar(select(func.count()).select_from(TrialConfigRow).where(TrialConfigRow.study_name == study)) or 0


# The last assessment per study, with the number of finished trials it saw: the model is refit
# only after a new result, not at every lease.  A per-process memo (never the source of truth:
# any process recomputes it from the trials), bounded.
_ASSESSED: OrderedDict[str, tuple[int, convergence.Assessment]] = OrderedDict()
_ASSESSED_MAX = 256
_ASSESSED_LOCK = threading.Lock()


def converges(spec: StudySpec) -> bool:
    """The convergence stop asks the `auto` sampler's model; other samplers run to their caps."""
    return spec.budget.converge and spec.sampler == "auto"


def assess_convergence(spec: StudySpec, trials: Sequence[FrozenTrial]) -> convergence.Assessment | None:
    """Is the answer known (optimizer.convergence)?  None when the study does not converge.

    `trials` as for `maybe_finish` (read before any write transaction).
    """
    if not converges(spec):
        return None
    done = sum(1 for t in trials if t.state.is_finished())
    with _ASSESSED_LOCK:
        hit = _ASSESSED.get(spec.name)
    if hit is not None and hit[0] == done:
        return hit[1]
    a = convergence.assess(spec, list(trials))
    with _ASSESSED_LOCK:
        _ASSESSED[spec.name] = (done, a)
        _ASSESSED.move_to_end(spec.name)
        while len(_ASSESSED) > _ASSESSED_MAX:
            _ASSESSED.popitem(last=False)
    return a


def converged_reason(spec: StudySpec, trials: Sequence[FrozenTrial]) -> str | None:
    """The convergence stop's reason when the study is settled, else None.

    The lease service asks it before asking for a new configuration, so a settled study hands
    out no more search trials (refit only after a new result).
    """
    a = assess_convergence(spec, trials)
    return a.reason if a is not None and a.settled else None


# A host's baseline that moved by more than this between two measurements has drifted: its
# confirmations then each get a baseline right before them (optimizer.confirmation).
DRIFT_MARGIN = 0.02


def confirm_baseline_serves(s: Session, spec: StudySpec, worker_id: str, base: BaselineRow) -> bool:
    """May this worker's latest baseline pair with its next confirmation?

    One fresh baseline (measured after the confirmation began) serves every confirmation on a
    host; where the host's baseline drifted (it differs from its last one before the
    confirmation began by more than DRIFT_MARGIN) each confirmation needs one measured after the previous confirmation ended
    (`optimizer.confirmation.baseline_serves`).  Called by the lease service.
    """
    started = s.scalar(
        select(func.min(LeaseRow.created_at)).where(LeaseRow.study_name == spec.name, LeaseRow.kind == "confirm")
    )
    if started is None:
        return False
    last = s.scalar(
        select(func.max(LeaseRow.finished_at)).where(
            LeaseRow.study_name == spec.name, LeaseRow.kind == "confirm", LeaseRow.worker_id == worker_id
        )
    )
    prev = s.scalars(
        select(BaselineRow)
        .where(
            BaselineRow.worker_id == worker_id,
            BaselineRow.baseline_key == base.baseline_key,
            BaselineRow.measured_at < started,
        )
        .order_by(BaselineRow.measured_at.desc())
        .limit(1)
    ).first()
    drift = prev is not None and confirm.drift_seen(_levels_of(base), _levels_of(prev), DRIFT_MARGIN)
    return confirm.baseline_serves(
        base.measured_at.timestamp(),
        started.timestamp(),
        None if last is None else last.timestamp(),
        drift,
    )


def study_cost(s: Session, name: str) -> costs.Cost:
    """Every launch of the study that ran to an end, with its wall time and its host's GPUs."""
    rows = s.scalars(
        select(LeaseRow).where(
            LeaseRow.study_name == name,
            LeaseRow.state.in_(("completed", "failed")),
            LeaseRow.leased_at.is_not(None),
            LeaseRow.finished_at.is_not(None),
        )
    ).all()
    gpus = {w.id: len((w.inventory or {}).get("gpus") or []) for w in s.scalars(select(WorkerRow)).all()}
    out = []
    extra = 0
    for r in rows:
        extra += int(((r.result or {}).get("metrics") or {}).get("extra_passes") or 0)
        failure = (r.result or {}).get("failure") or {}
        if failure.get("kind") in ("refused", "lost"):
            continue  # nothing was launched for the study (a refusal, a worker shutting down)
        ran = r.state == "completed" and (r.result or {}).get("outcome", "ok") == "ok"
        kind = {"baseline": "baselines", "trial": "search", "confirm": "confirmation"}.get(r.kind, "search")
        assert r.leased_at is not None and r.finished_at is not None
        seconds = (r.finished_at - r.leased_at).total_seconds()
        out.append(costs.Launch(kind if ran else "failed", seconds, gpus.get(r.worker_id or "", 1) or 1))
    return costs.tally(out, extra_passes=extra)


def _levels_of(row: BaselineRow) -> list[dict[str, Any]]:
    return [{"concurrency": int(c), "output_tok_s": float(v)} for c, v in (row.tok_s or {}).items()]


def _unleased_running(s: Session, spec: StudySpec, trials: Sequence[FrozenTrial]) -> bool:
    """Does Optuna hold a RUNNING trial that no lease will finish (an ask whose lease was lost)?

    Such a trial is failed by the lease service after `orphan_grace_s`; until then the study must
    not finish around it.
    """
    running = [t for t in trials if t.state == TrialState.RUNNING]
    if not running:
        return False
    held = set(
        s.scalars(
            select(LeaseRow.trial_number).where(
                LeaseRow.study_name == spec.name, LeaseRow.kind == "trial", LeaseRow.state.in_(("queued", "active"))
            )
        )
    )
    return any(t.number not in held for t in running)


def space_exhausted(s: Session, spec: StudySpec, trials: Sequence[FrozenTrial]) -> bool:
    """Is every configuration of the space launched already, or known to fail (optimizer.infeasible)?"""
    launched = set(s.scalars(select(TrialConfigRow.config_key).where(TrialConfigRow.study_name == spec.name)).all())
    configs = space_configs(spec.search_space)
    if len(launched) >= len(configs):
        return True
    ooms = oom_points(list(trials))
    return all(c.key in launched or known_to_fail(c, ooms) is not None for c in configs)


def _finish(row: StudyRow, now: datetime, reason: str) -> None:
    row.state = "finished"
    row.finished_at = now
    row.finish_reason = reason[:256]
    log.info("study %s finished: %s", row.name, reason)


def study_noise(s: Session, spec: StudySpec, trials: Sequence[FrozenTrial]) -> LaunchNoise:
    """The launch-to-launch noise of this study's speedups, from the re-launches it made anyway.

    Every baseline launch of its baseline server (any study's: same server, same workload) and
    every completed confirmation (optimizer.confirmation.study_noise).
    """
    baselines = s.scalars(select(BaselineRow).where(BaselineRow.baseline_key == baseline_key(spec))).all()
    rows = s.scalars(
        select(LeaseRow).where(
            LeaseRow.study_name == spec.name, LeaseRow.kind == "confirm", LeaseRow.state == "completed"
        )
    ).all()
    return confirm.study_noise(
        trials,
        [(b.worker_id, b.metrics.get("levels") or []) for b in baselines],
        [c for c in (_confirm_measurement(r) for r in rows) if c is not None],
    )


def _confirm_measurement(
    r: LeaseRow,
) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(configuration key, levels, paired baseline levels) of a completed confirmation."""
    result = r.result or {}
    levels = (result.get("metrics") or {}).get("levels")
    base = (result.get("confirmation") or {}).get("baseline_levels")
    if not levels or not base:
        return None
    return str(r.config_key), levels, base


def resolve_order(s: Session, spec: StudySpec, base: BaselineRow, lease: LeaseRow) -> dict[str, Any]:
    """What a confirm lease's worker needs to measure more passes while the answer is undecided.

    The thresholds: 1.0 (pays at all), 1.0 + min_gain (pays enough to matter), and the speedups
    the study's other candidates confirmed (the runner-up).  The launch noise is read from the
    baselines and confirmations (the search's trials are in Optuna's storage, which is not read
    inside this transaction); the cap is EXTRA_PASSES_PER_REPEAT x the workload's repeats.
    """
    others = s.scalars(
        select(LeaseRow).where(
            LeaseRow.study_name == spec.name,
            LeaseRow.kind == "confirm",
            LeaseRow.state == "completed",
            LeaseRow.trial_number != lease.trial_number,
        )
    ).all()
    baselines = s.scalars(select(BaselineRow).where(BaselineRow.baseline_key == baseline_key(spec))).all()
    noise = confirm.study_noise(
        [],
        [(b.worker_id, b.metrics.get("levels") or []) for b in baselines],
        [c for c in (_confirm_measurement(r) for r in others) if c is not None],
    )
    thresholds = sorted({1.0, 1.0 + spec.budget.min_gain, *(float(r.speedup) for r in others if r.speedup)})
    return {
        "levels": list(spec.workload.concurrency),
        "objective_concurrency": spec.objective.concurrency,
        "baseline_runs": {
            str(lv["concurrency"]): list(lv.get("output_tok_s_runs") or []) for lv in base.metrics.get("levels") or []
        },
        "thresholds": thresholds[:16],
        "extra_var": noise.variance,
        "max_passes": confirm.EXTRA_PASSES_PER_REPEAT * spec.workload.repeats,
    }


def start_confirmation(s: Session, spec: StudySpec, now: datetime, trials: Sequence[FrozenTrial]) -> bool:
    """Queue one confirm lease per candidate; False when there is nothing to confirm."""
    if spec.confirmation.top <= 0:
        return False
    noise = study_noise(s, spec, trials)
    chosen = confirm.candidates(list(trials), spec.confirmation.top, spec, noise.variance)
    if not chosen:
        return False
    capable = set(s.scalars(select(BaselineRow.worker_id).where(BaselineRow.baseline_key == baseline_key(spec))).all())
    for t in chosen:
        config = SpecConfig.model_validate(t.user_attrs["config"])
        measured_on = t.user_attrs.get("worker_id")
        payload = lease_payload(
            spec,
            config,
            confirm={
                # Another host than the one that found it, when the study has several.
                "avoid_worker": measured_on if len(capable - {measured_on}) > 0 else None,
                "search_speedup": t.value,
            },
        )
        s.add(
            new_lease_row(
                spec, LeaseKind.CONFIRM, now, 0.0, worker_id=None, config=config, number=t.number, payload=payload
            )
        )
    s.flush()
    return True


def _patience_reason(spec: StudySpec, trials: Sequence[FrozenTrial]) -> str | None:
    """Patience counts measured trials (not duplicates answered from earlier ones) since the best."""
    assert spec.budget.patience is not None
    best_value: float | None = None
    since_best = 0
    states = (TrialState.COMPLETE, TrialState.PRUNED)
    for t in sorted((t for t in trials if t.state in states), key=lambda t: t.number):
        if "duplicate_of" in t.user_attrs or "inferred_from" in t.user_attrs:
            continue
        if (
            t.state == TrialState.COMPLETE
            and t.value is not None
            and opt.is_feasible(t)
            and (best_value is None or t.value > best_value)
        ):
            best_value, since_best = t.value, 0
        else:
            since_best += 1
    if best_value is not None and since_best >= spec.budget.patience:
        return f"patience={spec.budget.patience}: no improvement in the last {since_best} trials"
    return None


class StudyService:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def create(self, spec: StudySpec, owner: int | None = None) -> dict[str, Any]:
        """Store a new study; `owner` (a token id) is held to `max_running_studies_per_user`."""
        validate_spec(spec, max_configs=self.ctx.settings.max_space_configs)
        # One owner's creations are serialised, so two at once cannot both pass the limit.
        with self.ctx.unit(lock=None if owner is None else f"studies-of-token:{owner}") as u:
            if owner is not None:
                with u.step() as s:
                    self._check_running_limit(s, owner)
            # Optuna's unique study name is the arbiter of "name taken": it is checked first, and
            # our row follows.  (On SQLite our transaction must not hold the write lock meanwhile.)
            opt.create_study(self.ctx.storage, spec, prior=self.prior_best(spec))
            with u.step() as s:
                s.add(
                    StudyRow(
                        name=spec.name,
                        state="running",
                        spec=spec.model_dump(mode="json"),
                        baseline_key=baseline_key(spec),
                        created_at=db_now(s),
                        created_by=owner,
                    )
                )
        return self.show(spec.name)

    def _check_running_limit(self, s: Session, owner: int) -> None:
        limit = self.ctx.settings.max_running_studies_per_user
        running = s.scalar(
            select(func.count()).select_from(StudyRow).where(StudyRow.created_by == owner, StudyRow.state == "running")
        )
        if (running or 0) >= limit:
            raise LimitReachedError(
                f"this token already has {running} running studies, the limit "
                f"(SPECTUNE_MAX_RUNNING_STUDIES_PER_USER={limit}); stop one (`spectune study stop NAME`) "
                "or ask an admin to raise the limit",
                field="name",
            )

    def prior_best(self, spec: StudySpec) -> list[SpecConfig]:
        """Warm starts from finished studies of the same model on the same hardware.

        Same model: target, draft, tp size, attention backend and page size.  Same hardware:
        the same placement labels, and the GPUs of the worker that measured the old winner are a
        model that registered workers holding this target have today (when any are known).
        Their winner and per-level winners come first, most recent study first (at most 4).
        """
        m = spec.model
        with self.ctx.sessions() as s:
            rows = s.scalars(
                select(StudyRow)
                .where(StudyRow.state == "finished", StudyRow.name != spec.name)
                .order_by(StudyRow.finished_at.desc())
                .limit(20)
            ).all()
            workers = {w.id: w.inventory for w in s.scalars(select(WorkerRow)).all()}
        gpus_now = {
            g.get("name")
            for inv in workers.values()
            if m.target in (inv.get("models") or [])
            for g in inv.get("gpus") or []
        }
        out: list[SpecConfig] = []
        for row in rows:
            other = runnable_spec(row)
            if other is None:
                continue
            o = other.model
            same_model = (o.target, o.draft, o.tp_size, o.attention_backend, o.page_size) == (
                m.target, m.draft, m.tp_size, m.attention_backend, m.page_size
            )  # fmt: skip
            if not same_model or other.placement != spec.placement:
                continue
            shown = self.show(row.name)
            winner = shown.get("winner")
            if winner is None:
                continue
            measured_on = workers.get(winner.get("confirmed_on") or winner.get("worker_id") or "", {})
            gpus_then = {g.get("name") for g in measured_on.get("gpus") or []}
            if gpus_now and gpus_then and not gpus_then & gpus_now:
                continue
            configs = [winner["config"]] + [a["config"] for a in (shown.get("best_by_level") or {}).values()]
            for c in configs:
                cfg = SpecConfig.model_validate(c)
                if cfg.key not in {x.key for x in out}:
                    out.append(cfg)
        return out[:4]

    def list_studies(self) -> list[dict[str, Any]]:
        """Every study with its trial counts: two queries, however many studies there are."""
        with self.ctx.sessions() as s:
            rows = s.execute(
                select(StudyRow.name, StudyRow.state, StudyRow.created_at, StudyRow.spec).order_by(
                    StudyRow.created_at, StudyRow.name
                )
            ).all()
        counts = trial_counts(self.ctx.rdb.engine)
        return [
            {
                "name": name,
                "state": state,
                "created_at": created_at,
                "model": ((spec or {}).get("model") or {}).get("target"),
                "trials": counts.get(name) or empty_counts(),
            }
            for name, state, created_at, spec in rows
        ]

    def _trial_counts(self, name: str) -> tuple[dict[str, int], list[FrozenTrial]]:
        study = optuna.load_study(study_name=name, storage=self.ctx.storage)
        with self.ctx.sessions() as s:
            quarantine = trial_records.quarantined(s, name)
        # Every reader of the document gets screened trials (api.services.trial_records).
        trials = trial_records.screened(study.get_trials(deepcopy=False), quarantine)
        counts = {state.name: 0 for state in TrialState}
        for t in trials:
            counts[t.state.name] += 1
        return counts, trials

    def stop(self, name: str) -> dict[str, Any]:
        with self.ctx.unit() as u, u.step() as s:
            row = s.get(StudyRow, name)
            if row is None:
                raise StudyNotFoundError(name)
            if row.state == "running":
                row.state = "stopped"
                row.finished_at = db_now(s)
                row.finish_reason = "stopped by a user"
            elif row.state == "stopped":
                pass  # stopping twice is harmless
            else:
                raise ConflictError(f"study {name!r} is already {row.state}")
            brief = {"name": row.name, "state": row.state, "finish_reason": row.finish_reason}
        try:
            return self.show(name)
        except ConflictError:  # a spec an older version stored: stopped all the same
            return brief

    def resume(self, name: str) -> dict[str, Any]:
        """Stopped -> running; the budget rules then apply as before (max_hours counts from creation)."""
        with self.ctx.unit() as u, u.step() as s:
            row = s.get(StudyRow, name)
            if row is None:
                raise StudyNotFoundError(name)
            if row.state == "stopped":
                if row.created_by is not None:
                    # Stop, create, resume must not get around the limit.
                    self._check_running_limit(s, row.created_by)
                row.state = "running"
                row.finished_at = None
                row.finish_reason = None
            elif row.state == "finished":
                raise ConflictError(
                    f"study {name!r} is finished (its budget is used); create a new study of the same model: "
                    "it starts from this one's answers"
                )
        return self.show(name)

    def show(self, name: str) -> dict[str, Any]:
        with self.ctx.sessions() as s:
            row = s.get(StudyRow, name)
            if row is None:
                raise StudyNotFoundError(name)
            spec = stored_spec(row)
            launched = s.scalar(
                select(func.count()).select_from(TrialConfigRow).where(TrialConfigRow.study_name == name)
            )
            baselines_measured = s.scalar(
                select(func.count())
                .select_from(LeaseRow)
                .where(LeaseRow.study_name == name, LeaseRow.kind == "baseline", LeaseRow.state == "completed")
            )
            confirm_rows = s.scalars(
                select(LeaseRow)
                .where(LeaseRow.study_name == name, LeaseRow.kind == "confirm")
                .order_by(LeaseRow.created_at)
            ).all()
            cost = study_cost(s, name)
            refusals = [
                # Names, not host paths (rows stored before the API redacted them too).
                {"worker_id": e.worker_id, "at": e.at, "message": paths_to_names(e.detail or "")}
                for e in active_refusals(s, study=name)
            ]
            waiting = None if row.state != "running" else study_eligibility(s, spec).as_json()
            baseline_rows = s.scalars(
                select(BaselineRow)
                .where(BaselineRow.baseline_key == row.baseline_key)
                .order_by(BaselineRow.worker_id, BaselineRow.measured_at)
            ).all()
            # The latest baseline per host of this study's server and workload.
            latest = {b.worker_id: b for b in baseline_rows}
            baselines = [
                {"worker_id": w, "measured_at": b.measured_at, "tok_s": b.tok_s} for w, b in sorted(latest.items())
            ]
        counts, trials = self._trial_counts(name)
        with self.ctx.sessions() as s:
            noise = study_noise(s, spec, trials)
        extra = noise.variance
        confirmations = _confirmations(spec, confirm_rows, extra)
        best = opt.best_trial_of(trials)
        best_doc = None if best is None else self._describe_best(spec, best, extra)
        winner = self._winner(spec, trials, best, best_doc, confirmations, extra)
        measured = len(A.measured_feasible(trials))
        if row.state != "running":
            phase = "done" if row.state == "finished" else row.state
        else:
            phase = "confirmation" if confirmations else "search"
        exported = answers.adaptive_export(spec, trials, extra)
        pays = _winner_pays(winner)
        deployment = deploy.plan_deployment(
            spec,
            None if winner is None else SpecConfig.model_validate(winner["config"]),
            pays=pays,
            exported=exported,
            version=(winner or {}).get("sglang_version") or DEFAULT_SGLANG_VERSION,
        )
        return {
            "name": name,
            "state": row.state,
            "phase": phase,
            # A study finished by older code may still carry the "confirming..." note of its last phase.
            "finish_reason": row.finish_reason
            if row.state == "running" or row.finish_reason is None
            else row.finish_reason.replace(CONFIRMING_SUFFIX, ""),
            "created_at": row.created_at,
            "finished_at": row.finished_at,
            "spec": row.spec,
            # The traffic every baseline and trial of this study measured, in words.
            "workload": describe_workload(spec.workload),
            "trials": counts,
            "configurations_launched": launched,
            "baselines_measured": baselines_measured,
            # Output tok/s without speculation per host and level: what every speedup divides by.
            "baselines": baselines,
            "best": best_doc,
            "winner": winner,
            "confirmation": confirmations,
            "best_by_level": {
                str(k): v.as_json() for k, v in answers.best_by_level(spec, trials, extra_var=extra).items()
            },
            # Launch-to-launch noise in every interval shown, and what it was estimated from.
            "launch_noise": noise.as_json(),
            "adaptive_spec": None if exported is None else exported.as_json(),
            "verdict": _verdict(winner, measured, deployment),
            # Launches and GPU-hours spent, by kind, next to SGLang's grid (optimizer.costs).
            "cost": cost.as_json(),
            # Workers that refused what this study asks (a study fault: they are not offered it
            # again, and it counts nothing against them).
            "refused_by": refusals,
            # Trials whose stored record holds values that fail today's checks: shown without
            # them (`spectune db repair-trial` removes them for good).
            "flagged_trials": [
                {"number": t.number, "problems": t.user_attrs[trial_records.PROBLEMS_ATTR]}
                for t in trials
                if trial_records.PROBLEMS_ATTR in t.user_attrs
            ],
            # Running studies: which workers can take it, and a warning naming the requirement none meets.
            "eligibility": waiting,
            # None until something was measured; then whether the deployed command speculates.
            "speculation_pays": None if winner is None else pays,
            "deployment": None if deployment is None else deployment.as_json(),
        }

    def _winner(
        self,
        spec: StudySpec,
        trials: list[FrozenTrial],
        best: FrozenTrial | None,
        best_doc: dict[str, Any] | None,
        confirmations: list[dict[str, Any]],
        extra_var: float = 0.0,
    ) -> dict[str, Any] | None:
        """The recommended configuration: the best confirmed one, else the best measured one.

        Confirmed candidates whose intervals overlap the best one's are a tie: the cheapest of
        them is the answer (optimizer.confirmation.choose).
        """
        done = [c for c in confirmations if c["state"] == "completed" and c.get("speedup") is not None]
        ok = [c for c in done if (c.get("violation") or 0.0) <= 0] or done
        # A saturated confirmation measured the host: any clean one comes first.
        ok = [c for c in ok if not c.get("saturated")] or ok
        if ok:
            choice = confirm.choose(ok, spec.budget.min_gain)
            top = choice.winner
            t = next(t for t in trials if t.number == top["trial_number"])
            doc = self._describe_best(spec, t, extra_var)
            doc |= {
                "search_speedup": t.value,
                "speedup": top["speedup"],
                "speedup_interval": top["speedup_interval"],
                "speedup_by_level": top["speedup_by_level"],
                "speedup_interval_by_level": top["speedup_interval_by_level"],
                "confirmed": True,
                "confirmed_on": top["worker_id"],
                "saturated": top.get("saturated") or {},
                # Confirmed candidates the answer cannot be told apart from (overlapping intervals).
                "ties": [
                    {"trial_number": c["trial_number"], "config": c["config"], "speedup": c["speedup"]}
                    for c in choice.ties
                ],
                "tie_note": choice.note,
            }
            return doc
        if best is None or best_doc is None:
            return None
        iv = confirm.search_interval(spec, best, extra_var)
        out: dict[str, Any] = best_doc | {
            "search_speedup": best.value,
            "speedup_interval": None if iv is None else {"low": iv.low, "high": iv.high},
            "confirmed": False,
            "confirmed_on": None,
            "saturated": {
                str(k): v
                for k, v in confirm.saturated_levels(
                    best.user_attrs.get("levels"), best.user_attrs.get("baseline_levels")
                ).items()
            },
        }
        return out

    @staticmethod
    def _describe_best(spec: StudySpec, t: FrozenTrial, extra_var: float = 0.0) -> dict[str, Any]:
        config = SpecConfig.model_validate(t.user_attrs["config"])
        version = t.user_attrs.get("sglang_version") or DEFAULT_SGLANG_VERSION
        static = deploy.plan_deployment(spec, config, pays=True, exported=None, version=version)
        assert static is not None
        return {
            "trial_number": t.number,
            "params": t.params,
            "config": config.model_dump(mode="json"),
            "speedup": t.value,
            "speedup_by_level": t.user_attrs.get("speedup_by_level"),
            "speedup_interval_by_level": {
                str(c): {"low": iv.low, "high": iv.high}
                for c, iv in level_intervals(
                    t.user_attrs.get("levels") or [], t.user_attrs.get("baseline_levels") or [], extra_var
                ).items()
            },
            "levels": t.user_attrs.get("levels"),
            "worker_id": t.user_attrs.get("worker_id"),
            "sglang_version": version,
            # This configuration deployed for the study's serving envelope (model paths are placeholders).
            "launch_command": static.command(),
        }

    def trials(self, name: str) -> list[dict[str, Any]]:
        with self.ctx.sessions() as s:
            if s.get(StudyRow, name) is None:
                raise StudyNotFoundError(name)
        _, trials = self._trial_counts(name)
        out = []
        for t in trials:
            ua = t.user_attrs
            out.append(
                {
                    "number": t.number,
                    "state": t.state.name,
                    "params": t.params,
                    "config": ua.get("config"),
                    "speedup": t.value,
                    "feasible": opt.is_feasible(t),
                    "constraints": t.constraints,
                    "speedup_by_level": ua.get("speedup_by_level"),
                    "levels": ua.get("levels"),
                    # The baseline each level's speedup divides by (same host, measured before it).
                    "baseline_levels": ua.get("baseline_levels"),
                    "effective": ua.get("effective"),
                    "startup_s": ua.get("startup_s"),
                    "worker_id": ua.get("worker_id"),
                    "failure_kind": ua.get("failure_kind"),
                    "failure_message": ua.get("failure_message"),
                    "record_problems": ua.get(trial_records.PROBLEMS_ATTR),
                    "duplicate_of": ua.get("duplicate_of"),
                    # Not launched: needs at least the memory of this trial, which ran out of it.
                    "inferred_from": ua.get("inferred_from"),
                    # Why a PRUNED trial was stopped, and what it measured before.
                    "pruned": ua.get("pruned"),
                    "partial_speedup_by_level": ua.get("partial_speedup_by_level"),
                    # A trial given up after its attempts: the levels they measured before the end.
                    "levels_measured": ua.get(A.LEVELS_MEASURED),
                    # warm_start | prior_study | grid (enqueued), else the sampler's proposal.
                    "source": ua.get("source"),
                    # What the `auto` sampler predicted for it when it proposed it.
                    "model_prediction": ua.get("model_prediction"),
                    "datetime_start": t.datetime_start,
                    "datetime_complete": t.datetime_complete,
                }
            )
        return out


def _confirmations(spec: StudySpec, rows: Sequence[LeaseRow], extra_var: float = 0.0) -> list[dict[str, Any]]:
    """One entry per confirmed candidate: its latest attempt (a completed one wins).

    Intervals are recomputed from the stored passes with the study's launch noise as it stands
    now (it grows with every re-launch the study makes), not as it was when each was reported.
    """
    latest: dict[int, LeaseRow] = {}
    for r in rows:
        if r.trial_number is None:
            continue
        prev = latest.get(r.trial_number)
        if prev is None or prev.state != "completed":
            latest[r.trial_number] = r
    out = []
    for number, r in sorted(latest.items()):
        info = dict((r.result or {}).get("confirmation") or {})
        measured = _confirm_measurement(r) if r.state == "completed" else None
        if measured is not None:
            info |= confirm.confirm_result(spec, measured[1], measured[2], extra_var).as_json()
        out.append(
            {
                "trial_number": number,
                "config": r.payload.get("config"),
                "state": r.state,
                "attempt": r.attempt,
                "worker_id": r.worker_id,
                "search_speedup": (r.payload.get("confirm") or {}).get("search_speedup"),
                "speedup": r.speedup,
                "speedup_interval": info.get("speedup_interval"),
                "speedup_by_level": info.get("speedup_by_level"),
                "speedup_interval_by_level": info.get("speedup_interval_by_level"),
                "violation": info.get("violation"),
                "baseline_measured_at": info.get("baseline_measured_at"),
                "saturated": {
                    str(k): v
                    for k, v in confirm.saturated_levels(
                        ((r.result or {}).get("metrics") or {}).get("levels"), info.get("baseline_levels")
                    ).items()
                },
            }
        )
    return out


def study_eligibility(s: Session, spec: StudySpec) -> elig.Eligibility:
    """Whether any registered worker can take this study, from the workers' last inventories.

    Workers whose refusal of this study stands are not offered it (the lease service's filter):
    the study document and /metrics both count through here, so they agree.
    """
    refused = {e.worker_id for e in active_refusals(s, study=spec.name)}
    workers = [
        elig.WorkerView(w.id, w.inventory or {}, w.quarantined, w.quarantine_reason, w.id in refused)
        for w in s.scalars(select(WorkerRow)).all()
    ]
    return elig.eligibility(spec, workers)


def _winner_pays(winner: dict[str, Any] | None) -> bool:
    if winner is None or winner.get("speedup") is None or winner.get("saturated"):
        return False
    iv = winner.get("speedup_interval")
    value = float(winner["speedup"])
    return confirm.pays(value, None if iv is None else Interval(value, float(iv["low"]), float(iv["high"])))


def _verdict(winner: dict[str, Any] | None, measured: int, deployment: deploy.Deployment | None = None) -> str:
    if winner is None or winner.get("speedup") is None:
        return "no result yet"
    if (
        deployment is not None
        and deployment.mode == "adaptive"
        and not _winner_pays(winner)
        and not winner.get("saturated")
    ):
        # No configuration pays over every level, but one pays at some: the answer follows the load.
        return f"speculation pays at part of the load: {deployment.reason}"
    c = winner["config"]
    label = f"steps {c['num_steps']} / topk {c['topk']} / draft tokens {c['num_draft_tokens']} (trial {winner['trial_number']})"
    iv = winner.get("speedup_interval")
    interval = None if iv is None else Interval(float(winner["speedup"]), float(iv["low"]), float(iv["high"]))
    where = f" on {winner['confirmed_on']}" if winner.get("confirmed_on") else ""
    text = confirm.verdict(
        float(winner["speedup"]),
        interval,
        label=label,
        measured=measured,
        confirmed=bool(winner["confirmed"]),
        where=where,
        saturated={int(k): v for k, v in (winner.get("saturated") or {}).items()},
    )
    return f"{text}; {winner['tie_note']}" if winner.get("tie_note") else text
