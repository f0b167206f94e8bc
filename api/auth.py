"""Bearer tokens: creation, hashing, revocation and role checks.

Roles: `admin` (everything, incl. token management), `user` (studies and fleet views), `worker`
(lease and report only — least privilege for GPU hosts).  Tokens are stored as sha256 hashes.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.db import db_now, transaction
from api.errors import AuthError, ForbiddenError, InvalidInputError, NotFoundError
from api.models import ApiToken

Role = Literal["admin", "user", "worker"]
ROLES: tuple[Role, ...] = ("admin", "user", "worker")
TOKEN_PREFIX = "st_"


@dataclass(frozen=True)
class Principal:
    token_id: int
    name: str
    role: Role
    worker_id: str | None  # set for a worker token bound to one worker


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(
    factory: sessionmaker[Session], role: str, name: str = "", worker_id: str | None = None
) -> tuple[int, str]:
    """Store a new token; returns (id, token).  The token itself is shown once and never stored."""
    if role not in ROLES:
        raise InvalidInputError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}", field="role")
    if worker_id is not None and role != "worker":
        raise InvalidInputError("only worker tokens can be bound to a worker id", field="worker_id")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with transaction(factory) as s:
        row = ApiToken(
            name=name or role,
            role=role,
            token_hash=hash_token(token),
            worker_id=worker_id,
            created_at=db_now(s),
        )
        s.add(row)
        s.flush()
        return row.id, token


def revoke_token(factory: sessionmaker[Session], token_id: int) -> None:
    with transaction(factory) as s:
        row = s.get(ApiToken, token_id)
        if row is None:
            raise NotFoundError(f"no token with id {token_id}")
        if row.revoked_at is None:
            row.revoked_at = db_now(s)


def list_tokens(factory: sessionmaker[Session]) -> list[ApiToken]:
    with factory() as s:
        return list(s.scalars(select(ApiToken).order_by(ApiToken.id)))


def authenticate(session: Session, authorization: str | None) -> Principal:
    if not authorization:
        raise AuthError("missing bearer token: send 'Authorization: Bearer <token>' (see `spectune token create`)")
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthError("malformed Authorization header: expected 'Bearer <token>'")
    row = session.scalars(select(ApiToken).where(ApiToken.token_hash == hash_token(token))).first()
    if row is None:
        raise AuthError("unknown token")
    if row.revoked_at is not None:
        raise AuthError("this token was revoked; ask an admin for a new one")
    return Principal(token_id=row.id, name=row.name, role=row.role, worker_id=row.worker_id)  # type: ignore[arg-type]


def require_role(principal: Principal, *roles: Role) -> Principal:
    if principal.role == "admin" and "worker" not in roles:
        return principal
    if principal.role not in roles:
        raise ForbiddenError(f"a {principal.role} token may not do this; it needs the role {' or '.join(roles)}")
    return principal


def require_worker(principal: Principal, worker_id: str) -> Principal:
    require_role(principal, "worker")
    if principal.worker_id is not None and principal.worker_id != worker_id:
        raise ForbiddenError(f"this token is bound to worker {principal.worker_id!r}, not {worker_id!r}")
    return principal
