"""Reading a stored study: its spec, its baseline key, its trials, what it launched.

A neutral module both the study service and the lease service read from; it decides nothing
(the study's life is api.services.study_life's, with optimizer.conductor).
"""

from __future__ import annotations

import logging

import optuna
from optuna.trial import FrozenTrial
from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api.errors import ConflictError
from api.models import StudyRow, TrialConfigRow
from api.services import trial_records
from optimizer import study as opt
from optimizer.errors import StudyNotFoundError
from optimizer.plan import baseline_key
from optimizer.spec import StudySpec

log = logging.getLogger("spectune.api.studies")


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


def study_trials(storage: optuna.storages.BaseStorage, sessions: sessionmaker[Session], name: str) -> list[FrozenTrial]:
    """Every trial of a study, read from Optuna's storage for the conductor's snapshot.

    Read before our write transaction opens: on SQLite, calling Optuna while we hold the write
    lock would wait for ourselves (api/db.py install_sqlite_transactions).
    """
    # A trial an admin quarantined reads as a failure here too: Optuna still stores it COMPLETE
    # with its value, and it must not steer the stop rule, candidates or confirmations.
    with sessions() as s:
        quarantine = trial_records.quarantined(s, name)
    # Screened: a stored value that fails today's checks can never make a reader raise.
    return trial_records.screened(
        storage.get_all_trials(storage.get_study_id_from_name(name), deepcopy=False), quarantine
    )


def load_study(storage: optuna.storages.BaseStorage, sessions: sessionmaker[Session], spec: StudySpec) -> optuna.Study:
    """The study for asking and telling: its samplers see an admin-quarantined trial as a failure
    (trial_records.sampler_screen), as the conductor's snapshot does (`study_trials`)."""
    with sessions() as s:
        quarantine = trial_records.quarantined(s, spec.name)
    return opt.load_study(storage, spec, trial_records.sampler_screen(quarantine))


def launched_count(s: Session, study: str) -> int:
    """Configurations launched so far in a study (what the budget counts)."""
    return s.scalar(select(func.count()).select_from(TrialConfigRow).where(TrialConfigRow.study_name == study)) or 0
