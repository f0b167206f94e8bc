"""A study document can always be read (issue 18, item 4).

Seen: one report with `metrics.sglang_version: "garbage"` was stored, and from then on
`GET /v1/studies/{name}`, stop and resume answered 500 and `study show/best/export/report` failed;
nothing could repair it.  Reports are refused at the door now (tests/api/test_bounded_at_the_door.py);
these tests write bad values straight into the database, as an older version or a bug could have,
and read the study with a fresh API process (Optuna's cache would otherwise hold the good value).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from optuna.trial import TrialState
from sqlalchemy import create_engine, text

from tests.api.test_rest_flow import lease, ok_metrics
from tests.support.api_client import Api, make_settings, make_tokens
from tests.support.specs import small_spec


@contextmanager
def fresh_api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    from api.app import create_app

    settings = make_settings(db_url, artifact_dir=str(tmp_path / "artifacts"))
    with TestClient(create_app(settings)) as client:
        yield Api(client, make_tokens(db_url))


def _measured_study(api: Api) -> int:
    """A study with one measured trial; returns its number."""
    assert api.post("/v1/studies", "user", small_spec("records")).status_code == 201
    base = lease(api).json()
    assert api.post(f"/v1/leases/{base['lease_id']}/complete", "worker", ok_metrics(90.0)).status_code == 200
    trial = lease(api).json()
    report = ok_metrics(120.0, sglang_version="0.5.23")
    assert api.post(f"/v1/leases/{trial['lease_id']}/complete", "worker", report).status_code == 200
    return int(trial["trial_number"])


def _store(db_url: str, number: int, key: str, value: Any) -> None:
    """Overwrite one stored attribute of trial `number`, as a bug or an older version could have."""
    engine = create_engine(db_url)
    with engine.begin() as conn:
        trial_id = conn.execute(text("SELECT trial_id FROM trials WHERE number = :n"), {"n": number}).scalar_one()
        conn.execute(
            text("UPDATE trial_user_attributes SET value_json = :v WHERE trial_id = :t AND key = :k"),
            {"v": json.dumps(value), "t": trial_id, "k": key},
        )
    engine.dispose()


def _stored(db_url: str, number: int) -> dict[str, Any]:
    engine = create_engine(db_url)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT a.key, a.value_json FROM trial_user_attributes a JOIN trials t ON t.trial_id = a.trial_id "
                "WHERE t.number = :n"
            ),
            {"n": number},
        ).all()
    engine.dispose()
    return {k: json.loads(v) for k, v in rows}


def _readable(api: Api) -> dict[str, Any]:
    """Every read of the study answers, and so do stop and resume."""
    shown = api.get("/v1/studies/records", "user")
    assert shown.status_code == 200, shown.text
    assert api.get("/v1/studies/records/trials", "user").status_code == 200
    assert api.get("/v1/studies", "user").status_code == 200
    assert api.post("/v1/studies/records/stop", "user").status_code == 200
    assert api.post("/v1/studies/records/resume", "user").status_code == 200
    doc: dict[str, Any] = shown.json()
    return doc


def _trial(api: Api, number: int) -> dict[str, Any]:
    trials = {t["number"]: t for t in api.get("/v1/studies/records/trials", "user").json()}
    return trials[number]


def test_a_bad_stored_version_still_renders_with_the_trial_flagged(api: Api, db_url: str, tmp_path: Path) -> None:
    number = _measured_study(api)
    _store(db_url, number, "sglang_version", "garbage")
    with fresh_api(db_url, tmp_path) as fresh:
        doc = _readable(fresh)
        assert [f["number"] for f in doc["flagged_trials"]] == [number]
        assert "sglang_version" in doc["flagged_trials"][0]["problems"][0]
        # The measurement itself is sound: it is still the best, with the default version's command.
        assert doc["best"]["trial_number"] == number and doc["best"]["sglang_version"] == "0.5.23"
        assert _trial(fresh, number)["record_problems"]
        # The report renders too.
        from api.report import build_report, load_from_database

        assert "records" in build_report(load_from_database(db_url, "records")).html


def test_an_unreadable_measurement_reads_as_a_failed_trial(api: Api, db_url: str, tmp_path: Path) -> None:
    number = _measured_study(api)
    _store(db_url, number, "config", {"num_steps": "many"})
    _store(db_url, number, "levels", [{"concurrency": 1, "output_tok_s": "fast"}])
    with fresh_api(db_url, tmp_path) as fresh:
        doc = _readable(fresh)
        assert doc["best"] is None or doc["best"]["trial_number"] != number
        trial = _trial(fresh, number)
        assert (trial["state"], trial["failure_kind"]) == ("FAIL", "quarantined")
        assert "unreadable" in trial["failure_message"]


def spectune_db(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "api.cli", "db", *args], capture_output=True, text=True, timeout=600)


def test_an_admin_repairs_or_quarantines_a_trial_record(api: Api, db_url: str, tmp_path: Path) -> None:
    number = _measured_study(api)
    _store(db_url, number, "sglang_version", "garbage")
    r = spectune_db("repair-trial", "records", str(number), "--database-url", db_url)
    assert r.returncode == 0, r.stderr
    assert "removed sglang_version" in r.stdout and "quarantined" not in r.stdout
    stored = _stored(db_url, number)
    assert "sglang_version" not in stored and stored["levels"]  # the rest is untouched
    engine = create_engine(db_url)
    with engine.connect() as conn:
        kept = conn.execute(
            text("SELECT detail FROM spectune_events WHERE kind = 'trial_record_repaired'")
        ).scalar_one()
    engine.dispose()
    assert "garbage" in kept  # the original value is kept
    with fresh_api(db_url, tmp_path) as fresh:
        assert _readable(fresh)["flagged_trials"] == []
    # Nothing left to repair; a trial known to be wrong is quarantined by reason.
    again = spectune_db("repair-trial", "records", str(number), "--database-url", db_url)
    assert again.returncode == 0 and "nothing to repair" in again.stdout
    q = spectune_db("repair-trial", "records", str(number), "--quarantine", "forged baseline", "--database-url", db_url)
    assert q.returncode == 0 and "quarantined: forged baseline" in q.stdout
    with fresh_api(db_url, tmp_path) as fresh:
        doc = _readable(fresh)
        assert doc["best"] is None or doc["best"]["trial_number"] != number
        trial = _trial(fresh, number)
        assert trial["state"] == "FAIL" and "forged baseline" in trial["failure_message"]
    # A trial that does not exist is one clear line.
    missing = spectune_db("repair-trial", "records", "999", "--database-url", db_url)
    assert missing.returncode == 2 and "has no trial 999" in missing.stderr and "Traceback" not in missing.stderr


def _confirmation(number: int, config: dict[str, Any], speedup: float) -> Any:
    """A completed confirmation as the study document builds them (studies._confirmations)."""
    from api.documents import Confirmation

    return Confirmation.model_validate(
        {
            "trial_number": number,
            "config": config,
            "state": "completed",
            "attempt": 1,
            "worker_id": "w1",
            "search_speedup": speedup,
            "speedup": speedup,
            "speedup_interval": None,
            "speedup_by_level": {},
            "speedup_interval_by_level": {},
            "violation": None,
            "baseline_measured_at": None,
            "lease_id": f"lease-{number}",
            "server": None,
            "envelope_note": "",
            "levels": None,
            "baseline_levels": None,
            "extra_passes": 0,
            "saturated": {},
        }
    )


def test_a_quarantined_trial_no_longer_steers_the_study(api: Api, db_url: str, tmp_path: Path) -> None:
    from api.services.studies import StudyService
    from api.services.study_specs import load_study, spec_of, study_trials
    from api.services.trial_records import repair_trial

    good = _measured_study(api)
    forged = lease(api).json()
    report = ok_metrics(200.0, sglang_version="0.5.23")
    assert api.post(f"/v1/leases/{forged['lease_id']}/complete", "worker", report).status_code == 200
    forged_number = int(forged["trial_number"])
    assert _readable(api)["best"]["trial_number"] == forged_number  # the forged one leads, until...
    with fresh_api(db_url, tmp_path) as fresh:
        ctx = fresh.client.app.state.ctx  # type: ignore[attr-defined]
        repair_trial(ctx.write_sessions, "records", forged_number, quarantine="forged measurement")
        doc = _readable(fresh)
        assert doc["best"]["trial_number"] == good and doc["winner"]["trial_number"] == good
        # What the conductor, stop rule and confirmations read: the quarantined trial as a failure.
        snapshot = {t.number: t for t in study_trials(ctx.storage, ctx.sessions, "records")}
        assert snapshot[forged_number].state.name == "FAIL" and snapshot[forged_number].value is None
        assert snapshot[good].state.name == "COMPLETE"
        # What the samplers read when the service asks or tells: the same (study_specs.load_study).
        with ctx.sessions() as s:
            asking = load_study(ctx.storage, ctx.sessions, spec_of(s, "records"))
        assert forged_number not in {t.number for t in asking.get_trials(states=(TrialState.COMPLETE,))}
        # A confirmation the quarantined trial had is never the answer, however well it measured.
        service = StudyService(ctx)
        with ctx.sessions() as s:
            spec = spec_of(s, "records")
        trials = list(snapshot.values())
        confirmed = [
            _confirmation(forged_number, snapshot[forged_number].user_attrs["config"], 9.0),
            _confirmation(good, snapshot[good].user_attrs["config"], 1.2),
        ]
        winner = service._winner(spec, trials, snapshot[good], None, confirmed, shapes={})  # noqa: SLF001
        assert winner is not None and winner.trial_number == good and winner.confirmed


def _study_with_a_forged_trial(sampler: str, forged_told: str) -> tuple[Any, Any, int]:
    """Eight trials measured with the simulator, then one whose report was forged (1,000x the
    throughput), told as measured (`forged_told="value"`) or as a failure; (storage, spec, number)."""
    import optuna

    from optimizer import study as opt
    from tests.optimizer.test_model_sampler import attrs_for, spec, value_of

    sp = spec(sampler=sampler)
    storage = optuna.storages.InMemoryStorage()
    opt.create_study(storage, sp)
    for i in range(9):
        study = opt.load_study(storage, sp)
        asked = opt.ask(study, sp)
        a = attrs_for("moe-pcie", asked.config, [1])
        if i < 8:
            opt.tell_value(study, asked.number, value_of(a), 0.0, a)
            continue
        a["levels"] = [{**lv, "output_tok_s": lv["output_tok_s"] * 1000} for lv in a["levels"]]
        a["speedup_by_level"] = {k: v * 1000 for k, v in a["speedup_by_level"].items()}
        if forged_told == "value":
            opt.tell_value(study, asked.number, value_of(a), 0.0, a)
        else:
            opt.tell_failed(study, asked.number, a | {"failure_kind": "quarantined"})
        return storage, sp, asked.number
    raise AssertionError("unreachable")


@pytest.mark.parametrize("sampler", ["tpe", "auto"])
def test_no_sampler_sees_a_quarantined_measurement(sampler: str) -> None:
    """The samplers read Optuna's trials themselves: quarantined, a forged measurement must steer
    the next proposal no more than a failed trial does (trial_records.sampler_screen)."""
    import optuna

    from api.services.trial_records import sampler_screen
    from optimizer import study as opt

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    forged, sp, number = _study_with_a_forged_trial(sampler, "value")
    failed, _, _ = _study_with_a_forged_trial(sampler, "failed")
    seen_as_failed = opt.ask(opt.load_study(failed, sp), sp).config.key
    screened_study = opt.load_study(forged, sp, sampler_screen({number: "forged measurement"}))
    assert screened_study.get_trials(states=(TrialState.COMPLETE,))[-1].number != number
    assert opt.ask(screened_study, sp).config.key == seen_as_failed
    # The forged value does steer a sampler that reads it (what the screen is for).
    unscreened, _, _ = _study_with_a_forged_trial(sampler, "value")
    assert opt.ask(opt.load_study(unscreened, sp), sp).config.key != seen_as_failed
