"""Studies: create, list, show (with the answer a user wants), stop and resume.

A study's life (its phase, its confirmation, its finish) is decided by optimizer.conductor
through api.services.study_life, never here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api import documents as D
from api.artifacts import paths_to_names
from api.context import ServiceContext
from api.db import db_now
from api.errors import ConflictError, LimitReachedError
from api.models import BaselineRow, EventRow, LeaseRow, StudyRow, TrialConfigRow, WorkerRow
from api.optuna_tables import empty_counts, trial_counts
from api.services import adaptive_answer, estimates, launch_noise, study_life, trial_records
from api.services import eligibility as elig
from api.services.lease_rows import LeasePayload
from api.services.leasing.baseline import verify_probe_of
from api.services.leasing.expiry import lost_work_note
from api.services.leasing.records import DEPLOY_FAILED, DEPLOY_RETRY
from api.services.refusals import active_refusals
from api.services.study_specs import runnable_spec, stored_spec, verify_shapes
from optimizer import answer, costs, deploy, ranking
from optimizer import attrs as A
from optimizer import conductor as cond
from optimizer import confirmation as confirm
from optimizer import study as opt
from optimizer.analysis import Interval, LaunchNoise
from optimizer.errors import StudyNotFoundError
from optimizer.objective import describe, metric_words, objective_intervals
from optimizer.plan import baseline_key
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec, describe_workload, validate_spec
from optimizer.study_state import CONFIRMING_NOTE, Outcome, Phase, StudyState
from optimizer.verify_probe import VerifyShape

log = logging.getLogger("spectune.api.studies")

# The SGLang version a command is written for when a trial did not record the one it ran on.
DEFAULT_SGLANG_VERSION = "0.5.23"


def study_cost(s: Session, name: str) -> costs.Cost:
    """Every launch of the study that ran to an end, with its wall time and its host's GPUs."""
    rows = s.scalars(
        select(LeaseRow)
        .where(
            LeaseRow.study_name == name,
            LeaseRow.state.in_(("completed", "failed")),
            LeaseRow.leased_at.is_not(None),
            LeaseRow.finished_at.is_not(None),
        )
        # The document's earlier reads may hold a lease row that ran then and has ended since
        # (read committed): its instance must show this statement's row, not the one it held.
        .execution_options(populate_existing=True)
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


@dataclasses.dataclass(frozen=True)
class _RowState:
    """The study row's life, as the document shows it."""

    state: str
    phase: str
    finish_reason: str | None
    created_at: datetime
    finished_at: datetime | None


@dataclasses.dataclass(frozen=True)
class StudyRecords:
    """What a study document is built from (`StudyService._document`): read back for `show`,
    or what `create` just stored."""

    name: str
    row: _RowState
    spec: StudySpec
    launched: int
    baselines_measured: int
    confirm_rows: Sequence[LeaseRow]
    events: list[tuple[str, str]]
    cost: D.StudyCost
    plan: D.PlanCheck | None
    refusals: list[D.Refusal]
    eligibility: D.Eligibility | None
    lost_note: str | None
    baselines: list[D.HostBaseline]
    latest_levels: dict[str, list[Any]]
    counts: dict[str, int]
    trials: list[FrozenTrial]
    noise: LaunchNoise
    # Each host's probed verify cost, as the conductor's snapshot has it: the winner is ranked by
    # the model the conductor's `winner` fits (study_specs.verify_shapes).
    shapes: Mapping[str, VerifyShape]


class StudyService:
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def create(self, spec: StudySpec, owner: int | None = None) -> D.StudyDocument:
        """Store a new study; `owner` (a token id) is held to `max_running_studies_per_user`."""
        validate_spec(spec, max_configs=self.ctx.settings.max_space_configs)
        with self.ctx.sessions() as s:
            eligibility = study_eligibility(s, spec)
        # Before anything is stored: the rehearsals take seconds, and no lock is held meanwhile.
        planned = estimates.make(spec, len(eligibility.eligible_workers), self.ctx.settings)
        # One owner's creations are serialised, so two at once cannot both pass the limit.
        with self.ctx.unit(lock=None if owner is None else f"studies-of-token:{owner}") as u:
            if owner is not None:
                with u.step() as s:
                    self._check_running_limit(s, owner)
            # Optuna's unique study name is the arbiter of "name taken": it is checked first, and
            # our row follows.  (On SQLite our transaction must not hold the write lock meanwhile.)
            created = opt.create_study(self.ctx.storage, spec, prior=self.prior_best(spec))
            if planned is not None:
                estimates.keep(created, planned)
            with u.step() as s:
                created_at = db_now(s)
                s.add(
                    StudyRow(
                        name=spec.name,
                        state="running",
                        spec=spec.model_dump(mode="json"),
                        baseline_key=baseline_key(spec),
                        created_at=created_at,
                        created_by=owner,
                    )
                )
        return self._document(self._created(spec, created, created_at, eligibility))

    def _created(
        self, spec: StudySpec, created: optuna.Study, created_at: datetime, eligibility: elig.Eligibility
    ) -> StudyRecords:
        """A new study's records: what `create` just stored (its row, its Optuna study with the
        warm starts it enqueued and its estimate), and the baselines its server already has."""
        trials = trial_records.screened(created.get_trials(deepcopy=False))
        counts = {state.name: 0 for state in TrialState}
        for t in trials:
            counts[t.state.name] += 1
        cost = D.StudyCost(**costs.tally([]).as_json())
        row = StudyRow(name=spec.name, state=StudyState.RUNNING)  # not stored again: read by the estimate
        with self.ctx.sessions() as s:
            baselines, latest_levels = _host_baselines(s, baseline_key(spec))
            shapes = verify_shapes(s, spec)
            noise = launch_noise.study_noise(s, spec, trials)
            plan = estimates.against_actual(s, created, row, cost)
        # Nothing ran yet: no confirmation waits, no work was lost, no worker refused it.
        state = _RowState(StudyState.RUNNING, Phase.SEARCH, None, created_at, None)
        waiting = D.Eligibility(**eligibility.as_json())
        return StudyRecords(
            spec.name, state, spec, 0, 0, [], [], cost, plan, [], waiting, None, baselines, latest_levels, counts,
            trials, noise, shapes,
        )  # fmt: skip

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
            got = self._prior_answer(row.name, other)
            if got is None:
                continue
            host, configs = got
            measured_on = workers.get(host or "", {})
            gpus_then = {g.get("name") for g in measured_on.get("gpus") or []}
            if gpus_now and gpus_then and not gpus_then & gpus_now:
                continue
            for cfg in configs:
                if cfg.key not in {x.key for x in out}:
                    out.append(cfg)
        return out[:4]

    def _prior_answer(self, name: str, spec: StudySpec) -> tuple[str | None, list[SpecConfig]] | None:
        """What `prior_best` takes from a finished study, read from its records: the host its answer
        was measured on, and the configurations of its answer (the document's `winner`: the
        adaptive server's where its launch proved it) and of each level's best; None without one."""
        _, trials = self._trial_counts(name)
        with self.ctx.sessions() as s:
            rows = _confirm_rows(s, name)
            extra = launch_noise.study_noise(s, spec, trials).variance
            shapes = verify_shapes(s, spec)
        confirmations = _confirmations(spec, rows, extra)
        relaunched = _relaunched(rows, trials)
        proof = next((c for c in confirmations if c.adaptive and adaptive_answer.proven(c)), None)
        if proof is not None:
            assert proof.server is not None
            config, host = proof.server.speculative or proof.config, proof.worker_id
        else:
            best = opt.best_trial_of(trials)
            best_doc = None if best is None else self._describe_best(spec, best, extra)
            winner = self._winner(spec, trials, best, best_doc, confirmations, extra, relaunched, shapes=shapes)
            if winner is None:
                return None
            config, host = winner.config, winner.confirmed_on or winner.worker_id
        assert config is not None
        return host, [config, *(a.config for a in answer.best_by_level(spec, trials, extra_var=extra).values())]

    def list_studies(self) -> list[D.StudySummary]:
        """Every study with its trial counts: two queries, however many studies there are."""
        # The model's name is read by the database (->> on Postgres, json_extract on SQLite): decoding
        # every study's whole spec here was a tenth of the API's CPU under 300 studies and 13 readers.
        target = StudyRow.spec["model"]["target"].as_string()
        with self.ctx.sessions() as s:
            rows = s.execute(
                select(StudyRow.name, StudyRow.state, StudyRow.created_at, target).order_by(
                    StudyRow.created_at, StudyRow.name
                )
            ).all()
        counts = trial_counts(self.ctx.rdb.engine)
        return [
            D.StudySummary(
                name=name,
                state=state,
                created_at=created_at,
                model=model,
                trials=D.TrialCounts(**(counts.get(name) or empty_counts())),
            )
            for name, state, created_at, model in rows
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

    def stop(self, name: str) -> D.StudyDocument | D.StudyBrief:
        with self.ctx.unit() as u, u.step() as s:
            row = study_life.stop_by_user(s, name, db_now(s))
            brief = D.StudyBrief(name=row.name, state=row.state, finish_reason=row.finish_reason)
        try:
            return self.show(name)
        except ConflictError:  # a spec an older version stored: stopped all the same
            return brief

    def resume(self, name: str) -> D.StudyDocument:
        """Stopped -> running (study_life.resume); stop, create, resume must not get around the limit."""
        with self.ctx.unit() as u, u.step() as s:

            def admit(row: StudyRow) -> None:
                if row.created_by is not None:
                    self._check_running_limit(s, row.created_by)

            study_life.resume(s, name, admit)
        return self.show(name)

    def show(self, name: str) -> D.StudyDocument:
        return self._document(self._records(name))

    def _records(self, name: str) -> StudyRecords:
        """Everything the study document is built from, read from the database."""
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
            confirm_rows = _confirm_rows(s, name)
            events = [
                (e.kind, e.detail or "")
                for e in s.scalars(
                    select(EventRow)
                    .where(
                        EventRow.study_name == name,
                        EventRow.kind.in_((DEPLOY_RETRY, DEPLOY_FAILED, deploy.ADAPTIVE_FAILED)),
                    )
                    .order_by(EventRow.at)
                )
            ]
            cost = D.StudyCost(**study_cost(s, name).as_json())
            plan = estimates.against_actual(s, optuna.load_study(study_name=name, storage=self.ctx.storage), row, cost)
            refusals = [
                # Names, not host paths (rows stored before the API redacted them too).
                D.Refusal(worker_id=e.worker_id, at=e.at, message=paths_to_names(e.detail or ""))
                for e in active_refusals(s, study=name)
            ]
            waiting = None
            lost_note = None
            if row.state == StudyState.RUNNING:
                lost_note = lost_work_note(s, name, db_now(s))
                waiting = D.Eligibility(**study_eligibility(s, spec).as_json())
                if waiting.warning is None:
                    # A confirmation no host can take now says so (optimizer.conductor).
                    snap = study_life.snapshot(s, spec, db_now(s), (), self.ctx.settings, lock=False)
                    waiting.warning = None if snap is None else cond.confirmation_waits(snap)
            baselines, latest_levels = _host_baselines(s, row.baseline_key)
            shapes = verify_shapes(s, spec)
            state = _RowState(row.state, row.phase, row.finish_reason, row.created_at, row.finished_at)
        counts, trials = self._trial_counts(name)
        with self.ctx.sessions() as s:
            noise = launch_noise.study_noise(s, spec, trials)
        return StudyRecords(
            name, state, spec, launched or 0, baselines_measured or 0, confirm_rows, events, cost, plan, refusals,
            waiting, lost_note, baselines, latest_levels, counts, trials, noise, shapes,
        )  # fmt: skip

    def _document(self, rec: StudyRecords) -> D.StudyDocument:
        """The study document from its records: the answer, its proof and the verdict."""
        name, spec, row, trials, noise, confirm_rows, events = (
            rec.name, rec.spec, rec.row, rec.trials, rec.noise, rec.confirm_rows, rec.events
        )  # fmt: skip
        fresh_by_trial = _fresh_by_trial(confirm_rows)
        extra = noise.variance
        confirmations = _confirmations(spec, confirm_rows, extra)
        best = opt.best_trial_of(trials)
        best_doc = None if best is None else self._describe_best(spec, best, extra)
        winner = self._winner(
            spec, trials, best, best_doc, confirmations, extra, _relaunched(confirm_rows, trials), shapes=rec.shapes
        )
        measured = len(A.measured_feasible(trials))
        if row.state != StudyState.RUNNING:
            phase = "done" if row.state == StudyState.FINISHED else row.state
        else:
            phase = row.phase
        exported = answer.adaptive_export(spec, trials, extra)
        the_answer = _answer_of(winner, fresh_by_trial)
        pays = answer.pays(the_answer)
        version = DEFAULT_SGLANG_VERSION if winner is None else winner.sglang_version
        deployment = deploy.plan_deployment(
            spec, None if winner is None else winner.config, pays=pays, exported=exported, version=version
        )
        # An adaptive answer is what its own launch made of it (api.services.adaptive_answer).
        adaptive = adaptive_answer.outcome(
            spec,
            deployment,
            [r for r in confirm_rows if adaptive_answer.is_adaptive_proof(r)],
            [d for k, d in events if k == deploy.ADAPTIVE_FAILED],
            next((c for c in confirmations if c.adaptive), None),
            version,
        )
        if adaptive.fallback is not None:
            deployment = deploy.plan_deployment(
                spec, None if winner is None else winner.config, pays=pays, exported=None, version=version
            )
        best_static = None
        if adaptive.proven is not None:
            deployment, unproven = adaptive.proven, None
            record = next(c for c in confirmations if c.adaptive)
            # One record (issue 17 item 5): the answer is the adaptive launch everywhere, and the
            # static winner is shown as what it is, the best static configuration.
            best_static = winner
            winner = adaptive_answer.winner_of(record, best_static, trials, adaptive.proven.version)
        else:
            deployment, unproven = _proof(deployment, winner, confirmations, events)
            if adaptive.pending is not None and deployment is not None and deployment.mode == "adaptive":
                deployment = dataclasses.replace(deployment, proof_note=adaptive.pending)
        # Hosts whose baselines disagree beyond the noise seen: one is probably saturated.
        hosts_note = confirm.host_disagreement(rec.latest_levels, noise.variance / 2)
        if winner is not None:
            # One source for the printed command: the deployment (proven, the no-speculation
            # server, or with its proof note), or none; never a statically planned one.
            winner.launch_command = None if deployment is None else deployment.command()
        return D.StudyDocument(
            name=name,
            state=row.state,
            phase=phase,
            # While confirming: why the search ended, and that the candidates are being confirmed.
            finish_reason=row.finish_reason
            if row.finish_reason is None or row.state != StudyState.RUNNING or row.phase != Phase.CONFIRMATION
            else row.finish_reason + CONFIRMING_NOTE,
            created_at=row.created_at,
            finished_at=row.finished_at,
            spec=spec,
            # The traffic every baseline and trial of this study measured, in words.
            workload=describe_workload(spec.workload),
            objective=describe(spec.objective, spec.workload.concurrency),
            trials=D.TrialCounts(**rec.counts),
            configurations_launched=rec.launched,
            baselines_measured=rec.baselines_measured,
            # Output tok/s without speculation per host and level: what every speedup divides by.
            baselines=rec.baselines,
            # `best` is the answer everywhere (the winner: confirmed, else the search's best);
            # the search's own best measured trial is `best_measured`.
            best=winner,
            best_measured=best_doc,
            winner=winner,
            best_static=best_static,
            confirmation=confirmations,
            best_by_level={
                str(k): D.LevelAnswer(**v.as_json())
                for k, v in answer.best_by_level(spec, trials, extra_var=extra).items()
            },
            # Launch-to-launch noise in every interval shown, and what it was estimated from.
            launch_noise=D.LaunchNoise(**noise.as_json()),
            adaptive_spec=None if exported is None else D.AdaptiveExport(**exported.as_json()),
            verdict=_with_note(
                adaptive.verdict
                or _after(
                    adaptive.fallback,
                    unproven
                    or answer.verdict(
                        the_answer,
                        measured,
                        adaptive=deployment.reason if deployment and deployment.mode == "adaptive" else None,
                        metric=metric_words(spec.objective),
                    ),
                ),
                hosts_note,
            ),
            # Hosts whose baselines of the same server disagree beyond the noise seen (None: they agree).
            host_check=hosts_note,
            # Launches and GPU-hours spent, by kind, next to SGLang's grid (optimizer.costs).
            cost=rec.cost,
            plan=rec.plan,
            # Workers that refused what this study asks (a study fault: they are not offered it
            # again, and it counts nothing against them).
            refused_by=rec.refusals,
            # Trials whose stored record holds values that fail today's checks: shown without
            # them (`spectune db repair-trial` removes them for good).
            flagged_trials=[
                D.FlaggedTrial(number=r.number, problems=r.record_problems)
                for r in A.records(trials)
                if r.record_problems is not None
            ],
            # Running studies: which workers can take it, and a warning naming the requirement none meets.
            eligibility=rec.eligibility,
            waiting=rec.lost_note,
            outcome=_outcome(the_answer, deployment),
            # None until something was measured; then whether the deployed command speculates.
            speculation_pays=None if winner is None else pays or adaptive.proven is not None,
            deployment=None if deployment is None else D.Deployment(**deployment.as_json()),
        )

    def _winner(
        self,
        spec: StudySpec,
        trials: list[FrozenTrial],
        best: FrozenTrial | None,
        best_doc: D.BestTrial | None,
        confirmations: list[D.Confirmation],
        extra_var: float = 0.0,
        relaunched: Sequence[ranking.Relaunch] = (),
        *,
        shapes: Mapping[str, VerifyShape],
    ) -> D.Winner | None:
        """The recommended configuration: the best confirmed one, else the best measured one.

        Confirmed candidates whose intervals overlap the best one's are a tie: the cheapest of
        them is the answer (optimizer.answer.winner, as the conductor's re-launches choose), ranked
        by the model the conductor's `winner` fits: the same trials and the hosts' probed verify
        cost (`shapes`, study_specs.verify_shapes, what `conductor.Snapshot.verify_shapes` gives).
        """
        # Never a quarantined trial; a clean confirmation before a saturated one (optimizer.answer).
        configs = {t.number: A.TrialRecord(t).config_or_none for t in trials}
        done = {
            c.trial_number: c
            for c in confirmations
            if c.state == "completed" and c.speedup is not None and c.trial_number in configs
        }
        # Ranked by the model of every launch, the confirmations' too (optimizer.conductor.winner).
        rank = ranking.of(spec, trials, shapes, relaunched)
        choice = answer.winner(spec, trials, [_contender(c, configs) for c in done.values()], rank)
        if choice is not None:
            top = done[choice.winner.trial_number]
            t = next(t for t in trials if t.number == top.trial_number)
            doc = self._describe_best(spec, t, extra_var)
            return D.Winner(
                **doc.model_dump(
                    exclude={"speedup", "speedup_by_level", "speedup_interval_by_level", "worker_id", "levels"}
                ),
                search_speedup=t.value,
                speedup=top.speedup,
                speedup_interval=top.speedup_interval,
                speedup_by_level=top.speedup_by_level,
                speedup_interval_by_level=top.speedup_interval_by_level or {},
                # Only a launch by another token and host than the search's confirms (issue 35).
                confirmed=top.not_independent is None,
                confirmed_on=top.worker_id,
                not_independent=top.not_independent,
                # One record: the launch the answer's numbers come from, its host, what it measured.
                worker_id=top.worker_id,
                search_worker_id=doc.worker_id,
                lease_id=top.lease_id,
                levels=top.levels,
                baseline_levels=top.baseline_levels,
                server=top.server,
                envelope_note=top.envelope_note,
                saturated=top.saturated,
                # Confirmed candidates the answer cannot be told apart from (overlapping intervals).
                ties=[D.Tie(trial_number=c.trial_number, config=c.config, speedup=c.speedup) for c in choice.ties],
                tie_note=choice.note,
                confirmation_launches=top.launches,
            )
        if best is None or best_doc is None:
            return None
        iv = confirm.search_interval(spec, best, extra_var)
        r = A.TrialRecord(best)
        return D.Winner(
            **best_doc.model_dump(),
            search_speedup=best.value,
            speedup_interval=None if iv is None else D.Interval(low=iv.low, high=iv.high),
            confirmed=False,
            confirmed_on=None,
            saturated={str(k): v for k, v in confirm.saturated_levels(r.levels, r.baseline_levels).items()},
        )

    @staticmethod
    def _describe_best(spec: StudySpec, t: FrozenTrial, extra_var: float = 0.0) -> D.BestTrial:
        r = A.TrialRecord(t)
        version = r.sglang_version or DEFAULT_SGLANG_VERSION
        return D.BestTrial(
            trial_number=r.number,
            params=r.params,
            config=r.config,
            speedup=r.value,
            speedup_by_level=r.speedup_by_level,
            speedup_interval_by_level={
                str(c): D.Interval(low=iv.low, high=iv.high)
                for c, iv in objective_intervals(spec.objective, r.levels, r.baseline_levels, extra_var).items()
            },
            levels=_levels(r.levels if r.has(A.LEVELS) else None),
            worker_id=r.worker_id,
            sglang_version=version,
            # The answer's command comes from the deployment (`show`), never planned here.
            launch_command=None,
        )

    def trials(self, name: str) -> list[D.TrialRow]:
        with self.ctx.sessions() as s:
            if s.get(StudyRow, name) is None:
                raise StudyNotFoundError(name)
        _, trials = self._trial_counts(name)
        return [_trial_row(A.TrialRecord(t)) for t in trials]


def _levels(levels: Sequence[Mapping[str, Any]] | None) -> list[D.MeasuredLevel] | None:
    return None if levels is None else [D.MeasuredLevel.model_validate(lv) for lv in levels]


def _effective(values: Mapping[str, Any] | None) -> dict[str, D.EffectiveValue] | None:
    """What /server_info reported, as stored; a value of another shape than SGLang's is kept as its JSON text."""
    if values is None:
        return None
    out: dict[str, D.EffectiveValue] = {}
    for k, v in values.items():
        scalar = v is None or isinstance(v, str | int | float | bool)
        flat = isinstance(v, list) and all(x is None or isinstance(x, str | int | float | bool) for x in v)
        out[k] = v if scalar or flat else json.dumps(v, sort_keys=True)
    return out


def _trial_row(r: A.TrialRecord) -> D.TrialRow:
    prediction = r.model_prediction
    return D.TrialRow(
        number=r.number,
        state=r.state.name,
        params=r.params,
        config=r.config_or_none,
        speedup=r.value,
        feasible=opt.is_feasible(r.trial),
        constraints=r.trial.constraints,
        speedup_by_level=r.speedup_by_level,
        levels=_levels(r.levels if r.has(A.LEVELS) else None),
        # The baseline each level's speedup divides by (same host, measured before it).
        baseline_levels=_levels(r.baseline_levels if r.has(A.BASELINE_LEVELS) else None),
        effective=_effective(r.effective),
        startup_s=r.startup_s,
        worker_id=r.worker_id,
        failure_kind=r.failure_kind,
        failure_message=r.failure_message,
        record_problems=r.record_problems,
        duplicate_of=r.duplicate_of,
        # Not launched: needs at least the memory of this trial, which ran out of it.
        inferred_from=r.inferred_from,
        # Why a PRUNED trial was stopped, and what it measured before.
        pruned=None if r.pruned is None else D.PruneNote.model_validate(r.pruned),
        partial_speedup_by_level=r.partial_speedup_by_level,
        # A trial given up after its attempts: the levels they measured before the end.
        levels_measured=_levels(r.levels_measured),
        # warm_start | prior_study | grid (enqueued), else the sampler's proposal.
        source=r.source,
        # What the `auto` sampler predicted for it before its result: when it proposed it, or in flight.
        model_prediction=None if prediction is None else D.ModelPrediction.model_validate(prediction),
        datetime_start=r.trial.datetime_start,
        datetime_complete=r.trial.datetime_complete,
    )


def _confirmations(spec: StudySpec, rows: Sequence[LeaseRow], extra_var: float = 0.0) -> list[D.Confirmation]:
    """One entry per confirmed candidate: its latest attempt (a completed one wins).

    Intervals are recomputed from the stored passes with the study's launch noise as it stands
    now (it grows with every re-launch the study makes), not as it was when each was reported.
    """
    latest: dict[int, LeaseRow] = {}
    proof: LeaseRow | None = None
    # Every completed launch of a candidate (optimizer.conductor.relaunches may order more than one).
    launches: dict[int, list[tuple[list[Any], list[Any]]]] = {}
    for r in rows:
        m = launch_noise.confirm_measurement(r) if r.state == "completed" and r.trial_number is not None else None
        if m is not None and r.trial_number is not None and not adaptive_answer.is_adaptive_proof(r):
            launches.setdefault(r.trial_number, []).append((m[1], m[2]))
        if adaptive_answer.is_adaptive_proof(r):
            # The adaptive answer's launch (no trial number): its last completed attempt, else its last.
            if proof is None or r.state == "completed" or proof.state != "completed":
                proof = r
            continue
        if r.trial_number is None:
            continue
        prev = latest.get(r.trial_number)
        if prev is None or prev.state != "completed" or r.state == "completed":
            latest[r.trial_number] = r
    out = []
    # The candidates by trial number, then the adaptive launch (it comes last, as it is launched).
    entries: list[tuple[int | None, LeaseRow]] = [*sorted(latest.items()), *([] if proof is None else [(None, proof)])]
    for number, r in entries:
        info = dict((r.result or {}).get("confirmation") or {})
        measured = launch_noise.confirm_measurement(r) if r.state == "completed" else None
        pooled = launches.get(number, []) if number is not None else []
        if measured is not None:
            info |= confirm.pooled_result(spec, pooled or [(measured[1], measured[2])], extra_var).as_json()
        payload = LeasePayload.of(r)
        saturated = confirm.saturated_levels(
            ((r.result or {}).get("metrics") or {}).get("levels"), info.get("baseline_levels")
        )
        out.append(
            D.Confirmation(
                trial_number=number,
                config=payload.config,
                state=r.state,
                attempt=r.attempt,
                worker_id=r.worker_id,
                search_speedup=payload.confirm_info.search_speedup,
                speedup=info.get("speedup", r.speedup),
                speedup_interval=info.get("speedup_interval"),
                speedup_by_level=info.get("speedup_by_level"),
                speedup_interval_by_level=info.get("speedup_interval_by_level"),
                violation=info.get("violation"),
                baseline_measured_at=info.get("baseline_measured_at"),
                not_independent=info.get("not_independent"),
                # The launch: its lease, the server it started, what it measured (one record).
                lease_id=r.id,
                server=((r.result or {}).get("deployment") or {}).get("server"),
                envelope_note=((r.result or {}).get("deployment") or {}).get("note") or "",
                levels=None if measured is None else _levels(measured[1]),
                baseline_levels=None if measured is None else _levels(measured[2]),
                extra_passes=((r.result or {}).get("metrics") or {}).get("extra_passes") or 0,
                saturated={str(k): v for k, v in saturated.items()},
                adaptive=number is None,
                launches=max(1, len(pooled)),
            )
        )
    return out


def _contender(c: D.Confirmation, configs: Mapping[int, SpecConfig | None]) -> answer.Contender:
    """A completed confirmation of the document as the answer is chosen among them (`configs`:
    each trial's configuration, for a lease stored without its own)."""
    assert c.trial_number is not None and c.speedup is not None
    config = c.config or configs.get(c.trial_number)
    assert config is not None
    iv = c.speedup_interval
    return answer.Contender(
        trial_number=c.trial_number,
        config=config,
        speedup=c.speedup,
        interval=None if iv is None else Interval(c.speedup, iv.low, iv.high),
        search_speedup=c.search_speedup,
        launches=c.launches,
        violation=c.violation or 0.0,
        saturated={int(k): v for k, v in c.saturated.items()},
    )


def _relaunched(rows: Sequence[LeaseRow], trials: Sequence[FrozenTrial]) -> list[ranking.Relaunch]:
    """The completed confirmation launches of the study's candidates as the ranking's model reads
    them (optimizer.conductor.relaunched: the same launches, from the conductor's snapshot)."""
    configs = {t.number: A.TrialRecord(t).config_or_none for t in trials}
    out = []
    for r in rows:
        if r.state != "completed" or r.trial_number is None or adaptive_answer.is_adaptive_proof(r):
            continue
        m = launch_noise.confirm_measurement(r)
        config = configs.get(r.trial_number)
        if m is not None and config is not None:
            out.append(ranking.Relaunch(config, m[1], m[2], r.worker_id))
    return out


def _confirm_rows(s: Session, name: str) -> Sequence[LeaseRow]:
    """The study's confirmation leases, oldest first."""
    return s.scalars(
        select(LeaseRow).where(LeaseRow.study_name == name, LeaseRow.kind == "confirm").order_by(LeaseRow.created_at)
    ).all()


def _host_baselines(s: Session, key: str) -> tuple[list[D.HostBaseline], dict[str, list[Any]]]:
    """The latest baseline per host of a server and workload (`key`): as the document shows them,
    and their levels."""
    rows = s.scalars(
        select(BaselineRow)
        .where(BaselineRow.baseline_key == key)
        .order_by(BaselineRow.worker_id, BaselineRow.measured_at)
    ).all()
    latest = {b.worker_id: b for b in rows}
    shown = [
        D.HostBaseline(worker_id=w, measured_at=b.measured_at, tok_s=b.tok_s, verify_probe=verify_probe_of(b))
        for w, b in sorted(latest.items())
    ]
    return shown, {w: b.metrics.get("levels") or [] for w, b in latest.items()}


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


def _fresh_by_trial(rows: Sequence[LeaseRow]) -> dict[int, bool]:
    """Per confirmed trial: was its completed confirmation paired with a baseline measured for it?

    Confirmations recorded before the conductor said so count as fresh (they always were paired
    with a baseline measured after the confirmation began)."""
    out: dict[int, bool] = {}
    for r in rows:
        info = (r.result or {}).get("confirmation")
        if r.state == "completed" and r.trial_number is not None and info is not None:
            out[r.trial_number] = bool(info.get("baseline_fresh", True))
    return out


def _answer_of(winner: D.Winner | None, fresh_by_trial: dict[int, bool]) -> answer.Answer | None:
    """The study document's winner as the conductor's verdict reads it."""
    if winner is None or winner.speedup is None:
        return None
    c = winner.config
    # A winner the conductor re-launched (one launch straddled the decision: conductor.relaunches)
    # says its figure pools those launches.
    pooled = (
        f"; pooled over {winner.confirmation_launches} confirmation launches"
        if winner.confirmation_launches > 1
        else ""
    )
    label = (
        f"steps {c.num_steps} / topk {c.topk} / draft tokens {c.num_draft_tokens} (trial {winner.trial_number}{pooled})"
    )
    iv = winner.speedup_interval
    value = winner.speedup
    return answer.Answer(
        speedup=value,
        interval=None if iv is None else Interval(value, iv.low, iv.high),
        label=label,
        confirmed=winner.confirmed,
        confirmed_on=winner.confirmed_on,
        not_independent=winner.not_independent,
        fresh_baseline=fresh_by_trial.get(winner.trial_number, True),
        saturated={int(k): v for k, v in winner.saturated.items()},
        tie_note=winner.tie_note,
    )


def _proof(
    deployment: deploy.Deployment | None,
    winner: D.Winner | None,
    confirmations: list[D.Confirmation],
    events: list[tuple[str, str]],
) -> tuple[deploy.Deployment | None, str | None]:
    """The deployment as the launch that proved it started it, and a verdict when none did.

    A static answer confirmed in its deployment envelope is printed with the server that
    confirmation started (a smaller graph envelope after an out-of-memory start says so).  When
    the study confirmed candidates and none of their deployments started, there is no command to
    print: the verdict says so, with why.
    """
    failed = [d for k, d in events if k == DEPLOY_FAILED]
    retried = [d for k, d in events if k == DEPLOY_RETRY]
    if winner is None or deployment is None:
        return deployment, None
    if winner.confirmed and deployment.mode == "static" and winner.server is not None:
        c = winner.config
        mine = [d for d in retried if d.startswith(f"{c.num_steps}/{c.topk}/{c.num_draft_tokens} ")]
        note = mine[-1] if mine else ""
        if not note and winner.envelope_note:
            note = (
                "the planned envelope was skipped: a configuration needing no more graph memory ran out of memory "
                f"in it; started with {winner.envelope_note}"
            )
        return deployment.proven(str(winner.lease_id), winner.server, note), None
    tried = [c for c in confirmations if not c.adaptive and (c.server is not None or c.state == "failed")]
    if not winner.confirmed and failed and not any(c.state == "completed" for c in tried):
        return None, "no command: none of the candidates' deployments started (" + "; ".join(failed) + ")"
    # Not proven by a launch of this study, said with the command (proven_by stays None).
    if deployment.mode == "adaptive":
        note = (
            "not launched by this study as printed: its confirmations ran each configuration statically; "
            "the adaptive switch itself is SGLang's, unmeasured here"
        )
    elif deployment.mode == "no_speculation":
        note = "the study's baselines ran this server without speculation (sized as its trials were)"
    elif not winner.confirmed:
        note = "not confirmed: the search's envelope ran this configuration, not the printed one"
    else:
        note = ""
    return (deployment if not note else dataclasses.replace(deployment, proof_note=note)), None


def _outcome(the_answer: answer.Answer | None, deployment: deploy.Deployment | None) -> Outcome:
    """The verdict's kind, as the printed command bears it out: no command is no answer, and a
    command that speculates (an adaptive one that pays at part of the load too) pays."""
    kind = answer.outcome(the_answer)
    if deployment is None:
        return Outcome.NO_ANSWER
    if deployment.speculation and kind != Outcome.NO_ANSWER:
        return Outcome.PAYS
    return kind


def _after(first: str | None, verdict: str) -> str:
    return verdict if first is None else f"{first}: {verdict}"


def _with_note(verdict: str, note: str | None) -> str:
    return verdict if note is None else f"{verdict}; warning: {note}"
