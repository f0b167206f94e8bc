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
random value, mode 0600, on first start, written atomically; one left empty or short by an
interrupted start is replaced, with a log line).  Cookies that are not exactly this shape (huge or
non-ASCII numbers, thousands of digits, anything else) are refused with 401 before any lookup.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import tempfile
from datetime import timedelta
from pathlib import Path

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from api.auth import Principal
from api.db import db_now, file_lock, transaction
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
    found = _read_secret(path)
    if found is None or len(found) < MIN_SECRET_CHARS:
        return _make_secret_file(path).encode()
    return found.encode()


def _read_secret(path: Path) -> str | None:
    """The file's secret, "" when it holds none usable (empty, cut short, not text); None when absent."""
    try:
        return path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        return ""


def _make_secret_file(path: Path) -> str:
    """Create the secret file, or replace one with no usable secret, and return its secret.

    Written whole or not at all: a temporary file beside it, fsynced, renamed over it.  A full disk
    at the first start used to leave a 0-byte file that failed every later start ("must be at
    least 32 characters") until someone deleted it; now such a file is replaced, with a log line.
    Under a file lock, so processes starting at once agree on one value.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.parent, f"session-secret:{path.name}"):
        found = _read_secret(path)
        if found is not None and len(found) >= MIN_SECRET_CHARS:
            return found  # another process wrote it while this one waited
        value = secrets.token_urlsafe(48)
        _write_atomically(path, value + "\n")
    if found is None:
        log.info("created the dashboard session secret in %s (keep it out of database backups)", path)
    else:
        log.warning(
            "%s held no usable session secret (%d characters, at least %d needed: an interrupted first start, "
            "e.g. a full disk); replaced it with a new one (dashboard sign-ins made with the old one end)",
            path, len(found), MIN_SECRET_CHARS,
        )  # fmt: skip
    return value


def _write_atomically(path: Path, text: str) -> None:
    """Put `text` in `path` (mode 0600) so that a reader sees the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    # The rename itself survives a crash once the folder is synced.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
