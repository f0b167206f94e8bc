"""The two StudyStores (optimizer/store.py) hold a study alike: the service's on Postgres
(api/services/leasing/sql_store.py) and the rehearsal's in memory (optimizer/memory_store.py),
given the same conductor actions carried out by optimizer/actions.py, show the conductor the same
study.  A difference here is a benchmark that no longer measures what the service does."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select

from optimizer import actions, conductor, deploy
from optimizer import attrs as A
from optimizer.memory_store import MemoryStudy
from optimizer.store import LeaseRecord, StudyStore
from optimizer.study_state import Ending, FinishReason
from tests.support.api_client import make_settings, make_tokens
from tests.support.specs import small_spec

NOW = datetime(2026, 1, 1, tzinfo=UTC)
BASE = [{"concurrency": 1, "output_tok_s": 100.0, "output_tok_s_runs": [99.0, 101.0]}]


def _report(store: StudyStore, lease: LeaseRecord, number: int, speedup: float) -> None:
    """A trial measured at `speedup` x the host's baseline, told and its lease ended."""
    assert lease.config is not None
    attrs: dict[str, Any] = {
        A.WORKER_ID: lease.worker_id,
        A.CONFIG: lease.config.model_dump(mode="json"),
        A.CONFIG_KEY: lease.config.key,
        A.BASELINE_LEVELS: BASE,
    }
    levels = [{"concurrency": 1, "output_tok_s": 100.0 * speedup, "output_tok_s_runs": [100.0 * speedup] * 2}]
    state, _ = actions.tell_measured(store.study(), store.spec, number, levels, {1: 100.0}, attrs)
    store.set_config_state(lease.config.key, state)
    store.end_lease(lease, "completed", NOW)


def _carry_out(store: StudyStore, confirm_lease: Any) -> list[str]:
    """The same actions on either store; returns the trial numbers' configuration keys."""
    spec = store.spec
    first = actions.ask(store, "w1", NOW)
    second = actions.ask(store, "w2", NOW)
    assert first is not None and second is not None
    _report(store, first[0], first[1].number, 1.25)
    # The second host crashed: its trial is queued again (attempt 2 of 2).
    store.end_lease(second[0], "failed", NOW)
    assert actions.retry_or_give_up(store, second[0], NOW, "engine_crash", "the server died", 2) is None
    third = actions.ask(store, "w1", NOW)
    assert third is not None
    # Out of memory at start-up: the configuration is infeasible, not retried.
    told = actions.tell_failure(store.study(), third[1].number, "oom", "CUDA out of memory", {})
    assert told is not None
    store.set_config_state(third[1].config.key, told)
    store.end_lease(third[0], "failed", NOW)
    # The search ends; the measured configuration is confirmed on the other host, in its printed envelope.
    cfg = first[1].config
    env = deploy.deployment_envelopes(spec, cfg)[0]
    candidate = conductor.Candidate(first[1].number, cfg, 1.25, "w1", 0, env)
    store.persist(conductor.StartConfirmation(Ending(FinishReason.CONVERGED, "parity"), (candidate,)), NOW)
    snap = store.snapshot(NOW, ["w1", "w2"])
    assert snap is not None
    queued = next(le for le in snap.leases if le.kind == "confirm")
    lease = confirm_lease(queued.id)
    # Its host went silent: the confirmation ends and is queued again, unpaired.
    store.end_lease(lease, "failed", NOW)
    actions.retry_confirm(store, lease, NOW, "lease expired", max_attempts=2)
    return [first[1].config.key, second[1].config.key, third[1].config.key]


def _seen(snap: conductor.Snapshot | None) -> dict[str, Any]:
    """What the conductor reads, without the stores' own ids and clocks."""
    assert snap is not None
    return {
        "state": snap.state,
        "phase": snap.phase,
        "ending": snap.ending,
        "trials": [(t.number, t.state, t.value, t.params, t.constraints) for t in snap.trials],
        "launched": snap.launched,
        "leases": sorted(
            (
                repr((str(le.kind), str(le.state), le.trial_number, le.config_key, le.avoid_worker))
                + repr((le.config, le.tier, le.server, le.failure, le.measurement, le.independent))
            )
            for le in snap.leases
        ),
        "baselines": [(b.worker_id, dict(b.tok_s)) for b in snap.baselines],
    }


@contextmanager
def _both_stores(pg_db_url: str, tmp_path: Path, name: str) -> Iterator[tuple[Any, MemoryStudy, Any]]:
    """The study `name` created through the service: (its SQL store, an in-memory store of the
    same spec, the SQL store's lease record by id)."""
    from api.app import create_app
    from api.context import ServiceContext
    from api.models import LeaseRow
    from api.services.leasing.sql_store import SqlStudyStore, lease_record

    settings = make_settings(pg_db_url, artifact_dir=str(tmp_path / "artifacts"))
    tokens = make_tokens(pg_db_url)
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/studies", headers={"Authorization": f"Bearer {tokens['user']}"}, json=small_spec(name))
        assert r.status_code in (200, 201), r.text
    ctx = ServiceContext.open(settings)
    try:
        sql = SqlStudyStore(ctx, name)

        def sql_lease(lease_id: str) -> LeaseRecord:
            with ctx.sessions() as s:
                row = s.get(LeaseRow, lease_id)
                assert row is not None
                return lease_record(row)

        yield sql, MemoryStudy(sql.spec, NOW), sql_lease
    finally:
        ctx.close()


def test_the_memory_and_sql_stores_show_the_same_study_after_the_same_actions(pg_db_url: str, tmp_path: Path) -> None:
    from api.models import EventRow

    with _both_stores(pg_db_url, tmp_path, "parity") as (sql, memory, sql_lease):
        keys = _carry_out(sql, sql_lease)
        assert _carry_out(memory, lambda i: memory.lease(i).record()) == keys
        assert len(set(keys)) == 3
        seen = _seen(sql.snapshot(NOW))
        assert seen == _seen(memory.snapshot(NOW, ["w1", "w2"]))
        # Not a vacuous agreement: each action left its mark.
        leases = seen["leases"]
        assert sum("'trial', 'queued'" in le for le in leases) == 1  # the crashed trial's retry
        assert sum("'confirm', 'queued'" in le for le in leases) == 1  # the confirmation's next attempt
        assert sum("'confirm', 'failed'" in le for le in leases) == 1
        assert [t[1].name for t in seen["trials"]] == ["COMPLETE", "RUNNING", "COMPLETE"]
        with sql.ctx.sessions() as s:
            said = sorted(s.scalars(select(EventRow.kind).where(EventRow.study_name == "parity")))
        assert said == sorted(kind for kind, _, _ in memory.events) == ["confirm_requeued", "trial_requeued"]


def _confirm(store: StudyStore, lease_of: Any) -> tuple[dict[str, Any], list[str]]:
    """A trial measured, then the conductor's StartConfirmation (it and the adaptive proof) and a
    Reconfirm of it on another host in its second envelope; returns what the conductor sees and
    each queued confirmation's payload (optimizer.store.ConfirmInfo, as stored)."""
    spec = store.spec
    asked = actions.ask(store, "w1", NOW)
    assert asked is not None
    _report(store, asked[0], asked[1].number, 1.25)
    cfg = asked[1].config
    envs = deploy.deployment_envelopes(spec, cfg)
    proof = conductor.Candidate(None, cfg, None, None, 0, envs[0], adaptive=True)
    first = conductor.Candidate(asked[1].number, cfg, 1.25, "w1", 0, envs[0])
    store.persist(conductor.StartConfirmation(Ending(FinishReason.CONVERGED, "parity"), (first, proof)), NOW)
    again = conductor.Candidate(asked[1].number, cfg, 1.25, "w2", len(envs) - 1, envs[-1])
    store.persist(conductor.Reconfirm((again,), "straddles 1.0"), NOW)
    snap = store.snapshot(NOW, ["w1", "w2"])
    assert snap is not None
    infos = []
    for le in snap.leases:
        if le.kind == "confirm":
            info = lease_of(le.id).confirm
            assert info is not None
            infos.append(repr(sorted(info.as_json().items())))
    return _seen(snap), sorted(infos)


def test_a_start_confirmation_and_a_reconfirm_queue_the_same_confirmations_in_both_stores(
    pg_db_url: str, tmp_path: Path
) -> None:
    with _both_stores(pg_db_url, tmp_path, "parity2") as (sql, memory, sql_lease):
        seen, infos = _confirm(sql, sql_lease)
        assert (seen, infos) == _confirm(memory, lambda i: memory.lease(i).record())
        # Not vacuous: three confirmations queued, the adaptive proof under its own key and
        # without a tier, the Reconfirm on the other host.
        confirms = [le for le in seen["leases"] if "'confirm', 'queued'" in le]
        assert len(confirms) == 3
        assert sum(f"'{deploy.ADAPTIVE_KEY}'" in le for le in confirms) == 1
        assert sum("'adaptive', True" in i for i in infos) == 1
        assert sum("'avoid_worker', 'w2'" in i for i in infos) == 1
        assert seen["phase"].value == "confirmation"
