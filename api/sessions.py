"""Dashboard sessions: server-side records, cookies keyed by a secret the database never holds.

A sign-in (`/login`) stores a session row (the sha256 of a random id, the token, an expiry from
the database clock) and sets the cookie `<id>.<mac>`: the id (32 random bytes, url-safe) and its
HMAC-SHA256 under the server's session secret.  A request's cookie is accepted only when its MAC
verifies, its row exists and has not ended or expired, and its token is not revoked.  So:

* `/logout` ends the row: the same cookie never works again;
* revoking the token ends every session made with it, on the next request of every process;
* a reader of the database backup finds neither the secret nor a session id (only hashes), and
  cannot mint or revive a cookie.

The secret comes from `SPECTUNE_SESSION_SECRET`, or from `session_secret_file` (created with a
random value, mode 0600, on first start).  Cookies that are not exactly this shape (huge or
non-ASCII numbers, thousands of digits, anything else) are refused with 401 before any lookup.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
from datetime import timedelta
from pathlib import Path

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from api.auth import Principal
from api.db import db_now, transaction
from api.errors import AuthError
from api.models import ApiToken, DashboardSession
from api.settings import Settings

log = logging.getLogger("spectune.api.sessions")

SESSION_TTL_S = 12 * 3600
SECRET_FILE_NAME = "spectune-session-secret"
MIN_SECRET_CHARS = 32
# The whole cookie, ASCII only: 43 url-safe characters (32 bytes) and a 64-hex-digit MAC.
_COOKIE_RE = re.compile(r"([A-Za-z0-9_-]{43})\.([0-9a-f]{64})\Z", re.ASCII)
# Ended and expired rows are kept this long (an audit trail), then deleted at the next sign-in.
_KEEP_ENDED = timedelta(days=7)


def secret_file_path(settings: Settings) -> Path:
    if settings.session_secret_file:
        return Path(settings.session_secret_file)
    # Next to the artifact folder, not inside it: the dashboard serves files from that folder.
    artifacts = Path(settings.artifact_dir)
    return artifacts.parent / SECRET_FILE_NAME


def load_secret(settings: Settings) -> bytes:
    """The session key: from the environment, else from its file (created on first start)."""
    if settings.session_secret is not None:
        value = settings.session_secret.get_secret_value()
        if len(value) < MIN_SECRET_CHARS:
            raise ValueError(f"SPECTUNE_SESSION_SECRET must be at least {MIN_SECRET_CHARS} characters")
        return value.encode()
    path = secret_file_path(settings)
    try:
        value = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        value = _create_secret_file(path)
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"{path}: the session secret must be at least {MIN_SECRET_CHARS} characters")
    return value.encode()


def _create_secret_file(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(48)
    try:
        # O_EXCL: two processes starting at once agree on the first one's value.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text(encoding="ascii").strip()
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(value + "\n")
    log.info("created the dashboard session secret in %s (keep it out of database backups)", path)
    return value


def _sid_hash(sid: str) -> str:
    return hashlib.sha256(sid.encode()).hexdigest()


class SessionKeeper:
    """Starts, checks and ends dashboard sessions (one per process, built from the secret)."""

    def __init__(self, secret: bytes, ttl_s: int = SESSION_TTL_S) -> None:
        self._secret = secret
        self.ttl_s = ttl_s

    def _mac(self, sid: str) -> str:
        return hmac.new(self._secret, sid.encode(), hashlib.sha256).hexdigest()

    def start(self, factory: sessionmaker[Session], principal: Principal) -> str:
        """Record a session for this principal; returns the cookie value."""
        sid = secrets.token_urlsafe(32)
        with transaction(factory) as s:
            now = db_now(s)
            s.execute(delete(DashboardSession).where(DashboardSession.expires_at < now - _KEEP_ENDED))
            s.add(
                DashboardSession(
                    sid_hash=_sid_hash(sid),
                    token_id=principal.token_id,
                    created_at=now,
                    expires_at=now + timedelta(seconds=self.ttl_s),
                )
            )
        return f"{sid}.{self._mac(sid)}"

    def _sid(self, cookie: str) -> str:
        match = _COOKIE_RE.fullmatch(cookie)
        if match is None:
            raise AuthError("malformed session cookie: sign in again at /login")
        sid, mac = match.groups()
        if not hmac.compare_digest(self._mac(sid), mac):
            raise AuthError("invalid session: sign in again at /login")
        return sid

    def principal(self, factory: sessionmaker[Session], cookie: str) -> Principal:
        """The principal behind a cookie; AuthError when malformed, forged, ended, expired or revoked."""
        sid = self._sid(cookie)
        with factory() as s:
            row = s.scalars(select(DashboardSession).where(DashboardSession.sid_hash == _sid_hash(sid))).first()
            if row is None or row.ended_at is not None:
                raise AuthError("this session has ended: sign in again at /login")
            if row.expires_at < db_now(s):
                raise AuthError("the session expired: sign in again at /login")
            token = s.get(ApiToken, row.token_id)
            if token is None or token.revoked_at is not None:
                raise AuthError("the token behind this session was revoked; ask an admin for a new one")
            return Principal(token_id=token.id, name=token.name, role=token.role, worker_id=token.worker_id)  # type: ignore[arg-type]

    def end(self, factory: sessionmaker[Session], cookie: str) -> bool:
        """End the session of a well-formed cookie for good; False when there was none to end."""
        try:
            sid = self._sid(cookie)
        except AuthError:
            return False
        with transaction(factory) as s:
            row = s.scalars(select(DashboardSession).where(DashboardSession.sid_hash == _sid_hash(sid))).first()
            if row is None or row.ended_at is not None:
                return False
            row.ended_at = db_now(s)
            return True
