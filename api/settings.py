"""Service settings, read from SPECTUNE_* environment variables (or passed in by tests)."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from api.db import Waits
from optimizer.spec import MAX_SPACE_CONFIGS


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECTUNE_", extra="ignore")

    # The embedded default is a SQLite file next to where the service runs; production uses
    # postgresql+psycopg://user@host/db.
    database_url: str = "sqlite:///./spectune.db"
    # A lease is lost when no heartbeat arrives before its deadline (database clock).
    # Within what workers accept (spectune_protocol.MIN_HEARTBEAT_S..MAX_HEARTBEAT_S).
    heartbeat_interval_s: float = Field(default=30.0, ge=0.05, le=3600.0)
    lease_ttl_s: float = Field(default=120.0, gt=0)
    # A worker holding a lease is lost once it has sent nothing for this many heartbeat intervals
    # (database clock): its lease is reclaimed and reassigned then, not at the TTL
    # (docs/leases.md "Lost workers").  1.5: one missed beat plus half an interval for a late one
    # (the worker retries a beat within half an interval, workers/heartbeat.py), so another worker
    # can start the work within 2 intervals of the loss (issue 33).
    lost_after_beats: float = Field(default=1.5, ge=1.0, le=100.0)
    # A trial Optuna handed out without a recorded lease (the API died in between) is told FAIL
    # after this long; asks take milliseconds.
    orphan_grace_s: float = Field(default=30.0, ge=0)
    # How often a trial is handed out again after its lease expired or its host failed.
    max_attempts: int = Field(default=3, ge=1)
    # Baselines older than this are measured again, so drift cannot pose as speedup.
    baseline_max_age_s: float = Field(default=6 * 3600.0, gt=0)
    # A confirmation pairs only with a baseline its host measured no longer than this before,
    # not counting the time the host spent on the study's confirmations since (a host that sat
    # idle or ran other work measures a new one: optimizer.conductor.baseline_fresh).
    confirm_baseline_idle_s: float = Field(default=600.0, gt=0)
    # Consecutive host faults (crashes, lost leases) after which a worker gets no more work.
    quarantine_after: int = Field(default=3, ge=1)
    # A study whose search space holds more configurations is refused at creation (the tuner
    # scores every one of them on each ask; optimizer.spec.MAX_SPACE_CONFIGS says why).  At most
    # a million: the sampler and the conductor's "space exhausted" check hold the space in memory.
    max_space_configs: int = Field(default=MAX_SPACE_CONFIGS, ge=1, le=1_000_000)
    # How many worker ids one unbound worker token may speak for (each id is bound to the first
    # token that uses it, api.services.identity).  A fleet gives every host its own token.
    max_worker_ids_per_token: int = Field(default=64, ge=1, le=100_000)
    # Postgres: how long a statement may wait for a lock, and run, before it fails and the request
    # is answered 503 with Retry-After (api.db.Waits gives the defaults' sources).
    db_lock_timeout_ms: int = Field(default=Waits.lock_timeout_ms, ge=1, le=3_600_000)
    db_statement_timeout_ms: int = Field(default=Waits.statement_timeout_ms, ge=1, le=3_600_000)
    # Requests larger than this are refused with 413 before they are parsed.
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    # Running studies one token may have at once (admins too); creating one more answers 429
    # naming this limit.  Each running study is offered to every fitting worker, so one user's
    # hundred studies would crowd out everyone else's.
    max_running_studies_per_user: int = Field(default=20, ge=1)
    # Request threads per API process: for the lease protocol's calls (which may wait on a study's
    # lock) and for everything else.  Each runnable one competes with the event loop, where
    # /healthz is answered, for the GIL (benchmarks/README.md, "Many studies").
    protocol_threads: int = Field(default=12, ge=1, le=256)
    request_threads: int = Field(default=12, ge=1, le=256)
    # Rehearsals behind the estimate a study is created with (api.estimate, `spectune study plan`
    # in a child process): each is a whole study simulated, 1-3 s of one core, spent in the create
    # request.  0: none.  A create waits at most `estimate_timeout_s` for it (then: no estimate);
    # 20 s stays below the CLI's 30 s request time-out (api.cli.common.client).
    estimate_draws: int = Field(default=8, ge=0, le=200)
    estimate_timeout_s: float = Field(default=20.0, gt=0)
    # Folder for trial artifacts (server logs, benchmark JSON); optuna-dashboard reads the same.
    artifact_dir: str = "./spectune-artifacts"
    # The key of the dashboard's session cookies (api.sessions).  Never stored in the database, so
    # a database backup cannot mint a session.  Unset: read from `session_secret_file`, which is
    # created (random, mode 0600) on first start; default: `spectune-session-secret` next to the
    # artifact folder.  Several API processes must share one secret (the same value or file).
    session_secret: SecretStr | None = None
    session_secret_file: str | None = None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
