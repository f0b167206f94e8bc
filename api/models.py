"""spectune's own tables (Optuna keeps studies and trials in its own tables, in the same database).

Every table is prefixed `spectune_` so it can never clash with Optuna's schema, and Alembic
keeps its revision in `spectune_alembic_version` (Optuna's Alembic uses `alembic_version`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class ApiToken(Base):
    __tablename__ = "spectune_api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    # sha256 of the token: tokens are 256-bit random, so a fast hash is enough and the
    # database never holds a usable secret.
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # A worker token may be bound to one worker id: it can then act only as that worker.
    worker_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)


def _one_of(column: str, values: tuple[str, ...], name: str) -> CheckConstraint:
    """The database's copy of a state machine's vocabulary (migrations/versions/0002_state_checks.py)."""
    return CheckConstraint(f"{column} IN ({', '.join(repr(v) for v in values)})", name=name)


# The values of api/services/leasing/states.py's enums (a test checks they agree).
LEASE_STATES = ("queued", "active", "completed", "failed", "expired", "superseded")
LEASE_KINDS = ("baseline", "trial", "confirm")
STUDY_STATES = ("running", "stopped", "finished")
# optimizer/study_state.py's Phase and FinishReason (migrations/versions/0006).
STUDY_PHASES = ("search", "confirmation")
FINISH_RULES = (
    "max_trials", "max_hours", "space_exhausted", "converged", "does_not_pay", "patience", "stopped_by_user",
    "study_fault",
)  # fmt: skip
CONFIG_STATES = ("pending", "done", "infeasible", "pruned", "failed")


class StudyRow(Base):
    __tablename__ = "spectune_studies"
    __table_args__ = (
        _one_of("state", STUDY_STATES, "ck_study_state"),
        Index("ix_spectune_studies_created_by_state", "created_by", "state"),
        _one_of("phase", STUDY_PHASES, "ck_study_phase"),
        _one_of("finish_rule", FINISH_RULES, "ck_study_finish_rule"),
    )

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    # running: leases are handed out; stopped: by a user; finished: budget, patience or space used up.
    state: Mapped[str] = mapped_column(String(16), default="running")
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    baseline_key: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(256), nullable=True)
    # The id of the token that created it (the per-user limit on running studies counts these);
    # None for studies created before migration 0004.
    created_by: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The conductor's explicit phase of a running study (optimizer.conductor), when the
    # confirmation began, and why the search ended (a FinishReason; the words are in finish_reason).
    phase: Mapped[str] = mapped_column(String(16), default="search", server_default="search")
    confirmation_began_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    finish_rule: Mapped[str | None] = mapped_column(String(32), nullable=True)


class TrialConfigRow(Base):
    """One row per configuration launched in a study: the de-duplication key of restarts."""

    __tablename__ = "spectune_trial_configs"
    __table_args__ = (
        UniqueConstraint("study_name", "config_key", name="uq_trial_config"),
        _one_of("state", CONFIG_STATES, "ck_config_state"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    study_name: Mapped[str] = mapped_column(ForeignKey("spectune_studies.name", ondelete="CASCADE"))
    config_key: Mapped[str] = mapped_column(String(64))
    trial_number: Mapped[int] = mapped_column(Integer)
    # pending (leased or queued), done, infeasible (failed for the configuration's sake),
    # pruned (stopped early), failed (infrastructure, after its retries)
    state: Mapped[str] = mapped_column(String(16), default="pending")


class WorkerRow(Base):
    __tablename__ = "spectune_workers"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    inventory: Mapped[dict[str, Any]] = mapped_column(JSON)
    first_seen: Mapped[datetime] = mapped_column(DateTime)
    last_seen: Mapped[datetime] = mapped_column(DateTime)
    consecutive_host_failures: Mapped[int] = mapped_column(Integer, default=0)
    quarantined: Mapped[bool] = mapped_column(Boolean, default=False)
    quarantine_reason: Mapped[str | None] = mapped_column(String(512), nullable=True)


class LeaseRow(Base):
    __tablename__ = "spectune_leases"
    __table_args__ = (
        Index("ix_lease_worker_state", "worker_id", "state"),
        Index("ix_lease_state_deadline", "state", "deadline"),
        Index("ix_lease_study_state", "study_name", "state"),
        # At most one active lease per worker, enforced by the database across API processes.
        Index(
            "uq_lease_active_worker",
            "worker_id",
            unique=True,
            postgresql_where=text("state = 'active'"),
            sqlite_where=text("state = 'active'"),
        ),
        _one_of("state", LEASE_STATES, "ck_lease_state"),
        _one_of("kind", LEASE_KINDS, "ck_lease_kind"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    study_name: Mapped[str] = mapped_column(ForeignKey("spectune_studies.name", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16))
    # queued (waiting for a worker), active, completed, failed, expired, superseded
    state: Mapped[str] = mapped_column(String(16))
    worker_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    trial_number: Mapped[int | None] = mapped_column(Integer, nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    config_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    leased_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    deadline: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # The report as received (metrics or failure) and what we derived from it.
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    speedup: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The worker token that reported it (only the token it was granted to may: api.services.grants);
    # None before migration 0007.  Independence is judged by token, not worker id: one unbound
    # token may speak for several worker ids (issue 35).
    token_id: Mapped[int | None] = mapped_column(Integer, nullable=True)


class BaselineRow(Base):
    __tablename__ = "spectune_baselines"
    __table_args__ = (Index("ix_baseline_worker_key", "worker_id", "baseline_key", "measured_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    worker_id: Mapped[str] = mapped_column(String(128))
    baseline_key: Mapped[str] = mapped_column(String(64))
    lease_id: Mapped[str] = mapped_column(String(36))
    measured_at: Mapped[datetime] = mapped_column(DateTime)
    # {"<concurrency>": output tok/s}
    tok_s: Mapped[dict[str, Any]] = mapped_column(JSON)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)


class EventRow(Base):
    """An append-only log of what happened (lease reclaimed, late report kept, quarantine...)."""

    __tablename__ = "spectune_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime)
    kind: Mapped[str] = mapped_column(String(64))
    study_name: Mapped[str | None] = mapped_column(String(64), nullable=True)
    worker_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    detail: Mapped[str] = mapped_column(Text, default="")


class DashboardSession(Base):
    """A dashboard sign-in (`/login`): ended by `/logout`, its expiry, or its token's revocation.

    The cookie holds a random session id and an HMAC of it keyed by the server's session secret
    (api.sessions), which is never in the database; the row keeps only the id's sha256.  So a copy
    of the database can neither mint a cookie nor revive an ended session.
    """

    __tablename__ = "spectune_dashboard_sessions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sid_hash: Mapped[str] = mapped_column(String(64), unique=True)
    token_id: Mapped[int] = mapped_column(Integer, index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    expires_at: Mapped[datetime] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)


class LeaseGrant(Base):
    """Which token a lease was handed to: a worker token acts only on leases it was given."""

    __tablename__ = "spectune_lease_grants"

    lease_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    token_id: Mapped[int] = mapped_column(Integer)
    granted_at: Mapped[datetime] = mapped_column(DateTime)


class WorkerIdentity(Base):
    """Which worker token speaks for a worker id: bound on first use (api.services.identity).

    A token bound by an admin (`token create --worker-id`) needs no row: its binding is on the
    token.  Baselines, refusals and host health are kept per worker id, so they belong to the one
    token that may use that id; when the id moves to another token (its holder was revoked), the
    baselines measured before `moved_at` no longer count.
    """

    __tablename__ = "spectune_worker_identities"
    __table_args__ = (Index("ix_worker_identity_token", "token_id"),)

    worker_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    token_id: Mapped[int] = mapped_column(Integer)
    bound_at: Mapped[datetime] = mapped_column(DateTime)
    moved_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
