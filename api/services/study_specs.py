"""Reading a stored study: its spec, its baseline key, its trials, what it launched.

A neutral module both the study service and the lease service read from; it decides nothing
(the study's life is api.services.study_life's, with optimizer.conductor).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import optuna
from optuna.trial import FrozenTrial
from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api.errors import ConflictError
from api.models import BaselineRow, StudyRow, TrialConfigRow, WorkerIdentity
from api.services import trial_records
from optimizer import conductor
from optimizer import study as opt
from optimizer.errors import StudyNotFoundError
from optimizer.plan import baseline_key
from optimizer.spec import StudySpec
from optimizer.study_state import StudyState
from optimizer.verify_probe import VerifyShape, latest_shapes
from spectune_protocol import VerifyProbe

log = logging.getLogger("spectune.api.studies")


def parsed_spec(doc: dict[str, Any]) -> StudySpec:
    """A stored spec, validated once per distinct document (ValidationError when it fails).

    Every ask validated every running study's spec (`LeaseService._candidate_studies`): 300
    validations per lease at 300 studies, CPU that held the GIL against every other request and
    the event loop's health probes.  A stored spec never changes, so its canonical JSON is the key;
    the instances are shared, and nothing writes to a spec.
    """
    return _parsed(json.dumps(doc, sort_keys=True))


@functools.lru_cache(maxsize=2048)
def _parsed(doc: str) -> StudySpec:
    return StudySpec.model_validate(json.loads(doc))


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
        return parsed_spec(row.spec)
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
        return parsed_spec(row.spec)
    except ValidationError as e:
        log.warning("study %s is passed by: its stored spec fails today's checks (%s); stop it", row.name, e)
        return None


# Running studies' specs by (name, created_at): a study's spec never changes once stored, and a
# name created again is a new key.  Bounded; a study whose spec fails today's checks is kept as None.
_RUNNABLE: OrderedDict[tuple[str, datetime], StudySpec | None] = OrderedDict()
_RUNNABLE_MAX = 4096
_RUNNABLE_LOCK = threading.Lock()


def running_specs(s: Session) -> list[StudySpec]:
    """Every running study's spec, oldest first; one whose spec fails today's checks is passed by.

    Every ask reads them (LeaseService._candidate_studies): loading and validating every running
    study's stored spec cost CPU per ask that grew with the number of studies (300 at 300) and
    held the GIL against the event loop's health probes.  Only the names and creation times are
    read now; a spec is loaded and validated once.
    """
    keys = [
        (str(name), at)
        for name, at in s.execute(
            select(StudyRow.name, StudyRow.created_at)
            .where(StudyRow.state == StudyState.RUNNING)
            .order_by(StudyRow.created_at, StudyRow.name)
        )
    ]
    with _RUNNABLE_LOCK:
        missing = [name for name, at in keys if (name, at) not in _RUNNABLE]
    if missing:
        for row in s.scalars(select(StudyRow).where(StudyRow.name.in_(missing))):
            spec = runnable_spec(row)
            with _RUNNABLE_LOCK:
                _RUNNABLE[(row.name, row.created_at)] = spec
                while len(_RUNNABLE) > _RUNNABLE_MAX:
                    _RUNNABLE.popitem(last=False)
    with _RUNNABLE_LOCK:
        found = [_RUNNABLE.get(key) for key in keys]
    return [spec for spec in found if spec is not None]


def baseline_key_of(spec: StudySpec) -> str:
    return baseline_key(spec)


def study_baselines(s: Session, spec: StudySpec) -> list[conductor.Baseline]:
    """Every baseline under the study's baseline key, oldest first, as the conductor holds them
    (api.services.study_life.snapshot), each with its verify probe."""
    # A worker id that moved to another token: its baselines before the move are not its own.
    moved = {w: at for w, at in s.execute(select(WorkerIdentity.worker_id, WorkerIdentity.moved_at)) if at}
    return [
        conductor.Baseline(
            b.id,
            b.worker_id,
            b.measured_at,
            {int(k): float(v) for k, v in (b.tok_s or {}).items()},
            levels=(b.metrics or {}).get("levels") or [],
            valid=b.worker_id not in moved or b.measured_at >= moved[b.worker_id],
            verify_probe=None if (probe := stored_verify_probe(b.metrics)) is None else probe.model_dump(mode="json"),
        )
        for b in s.scalars(
            select(BaselineRow)
            .where(BaselineRow.baseline_key == baseline_key_of(spec))
            .order_by(BaselineRow.measured_at)
        )
    ]


def stored_verify_probe(metrics: Mapping[str, Any] | None) -> VerifyProbe | None:
    """The verify probe stored in a baseline's metrics (as reported), or None: measured by a worker
    older than the probe, or stored before the probe's fields were what they are now."""
    raw = (metrics or {}).get("verify_probe")
    if raw is None:
        return None
    try:
        return VerifyProbe.model_validate(raw)
    except ValueError:
        return None


def verify_shapes(s: Session, spec: StudySpec) -> dict[str, VerifyShape]:
    """Each host's newest probed verify cost shape, as the conductor's snapshot gives every fit
    (`conductor.Snapshot.verify_shapes`): the sampler's, and the study document's winner's."""
    return latest_shapes(study_baselines(s, spec))


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
    (trial_records.sampler_screen), as the conductor's snapshot does (`study_trials`), and fit
    with the hosts' probed verify cost, as the snapshot's stop rule and ranking do (`verify_shapes`)."""
    with sessions() as s:
        quarantine = trial_records.quarantined(s, spec.name)
        shapes = verify_shapes(s, spec)
    return opt.load_study(storage, spec, trial_records.sampler_screen(quarantine), shapes=shapes)


def launched_count(s: Session, study: str) -> int:
    """Configurations launched so far in a study (what the budget counts)."""
    return s.scalar(select(func.count()).select_from(TrialConfigRow).where(TrialConfigRow.study_name == study)) or 0
