"""Errors raised by the API package, and the one place where every error becomes HTTP.

    ApiError (status, code)
    ├── NotFoundError              404  unknown study, lease or worker, or an unknown /v1 path
    ├── MethodNotAllowedError      405  a known /v1 path with another method (Allow names them)
    ├── ConflictError              409  name taken, lease held elsewhere or already finished
    ├── LeaseGoneError             410  the lease expired and was reclaimed
    ├── AuthError                  401  no token, unknown or revoked token
    ├── ForbiddenError             403  the token's role may not do this
    ├── InvalidInputError          422  a field is wrong (names it)
    ├── PayloadTooLargeError       413  body over the configured limit
    ├── LimitReachedError          429  a per-token quota is used up (names it)
    ├── SchemaOutdatedError        503  the database schema is not at head (names the fix)
    ├── BusyError                  503  a lock could not be had in time; retry
    └── StorageUnavailableError    503  the database cannot be reached

Anything else that escapes a handler (a bug) is answered with the same shape and status 500
(`code: internal`), never a traceback; the traceback goes to the log, and the app counts it in
`spectune_http_unhandled_errors_total` (api.metrics).

Errors from `optimizer` (its own hierarchy) are mapped here too.  A response never carries a
database error's text: those (ours, and Optuna's StorageInternalError around them) are logged and
answered with a generic 503.  Every 503 carries `Retry-After`, which the worker honours.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from optuna.exceptions import StorageInternalError
from pydantic import BaseModel
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session
from starlette.exceptions import HTTPException as StarletteHTTPException

from optimizer.errors import OptimizerError, SpecError, StudyExistsError, StudyNotFoundError, TrialStateError

log = logging.getLogger("spectune.api")


class ApiError(Exception):
    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class NotFoundError(ApiError):
    status, code = 404, "not_found"


class MethodNotAllowedError(ApiError):
    status, code = 405, "method_not_allowed"

    def __init__(self, message: str, *, allow: list[str]) -> None:
        super().__init__(message)
        self.allow = allow


class ConflictError(ApiError):
    status, code = 409, "conflict"


class LeaseGoneError(ApiError):
    status, code = 410, "lease_gone"


class AuthError(ApiError):
    status, code = 401, "unauthorized"


class ForbiddenError(ApiError):
    status, code = 403, "forbidden"


class InvalidInputError(ApiError):
    status, code = 422, "invalid"


class PayloadTooLargeError(ApiError):
    status, code = 413, "payload_too_large"


class LimitReachedError(ApiError):
    """A per-user quota (running studies) is used up; the message names the limit and the way out."""

    status, code = 429, "limit_reached"


class SchemaOutdatedError(ApiError):
    status, code = 503, "schema_outdated"


class BusyError(ApiError):
    """Too many requests wait for the same lock; clients retry (the worker does, with back-off)."""

    status, code = 503, "busy"


class StorageUnavailableError(ApiError):
    status, code = 503, "storage_unavailable"


class ErrorDetail(BaseModel):
    code: str
    message: str
    field: str | None = None
    details: list[dict[str, str]] | None = None


class ErrorResponse(BaseModel):
    """The body of every error response."""

    error: ErrorDetail
    detail: str


# Documented on every operation; FastAPI's own 422 schema (HTTPValidationError) is replaced, since
# the handlers below answer validation errors in this shape too.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in (
        (401, "no, malformed, unknown or revoked token"),
        (403, "the token's role may not do this"),
        (404, "unknown study, lease or worker"),
        (405, "this path takes other methods; `Allow` names them"),
        (409, "conflict: name taken, lease ended or held elsewhere"),
        (410, "the lease expired and was reclaimed"),
        (413, "request body too large"),
        (422, "a field is invalid; `error.field` names it"),
        (429, "a per-token limit is reached (running studies, worker ids); the message names it"),
        (500, "a bug in spectune; the server log holds the details"),
        (503, "the database is unavailable or its schema is not at head"),
    )
}

INTERNAL_MESSAGE = "internal error: the server log has the details; please report it"
# Framework errors (no route for the method, a body that cannot be parsed) answered in our shape.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


def _body(code: str, message: str, field: str | None = None, **extra: Any) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        error["field"] = field
    error.update(extra)
    return {"error": error, "detail": message}


def _from_optimizer(exc: OptimizerError | SpecError) -> ApiError:
    if isinstance(exc, SpecError):
        return InvalidInputError(str(exc), field=exc.field)
    if isinstance(exc, StudyNotFoundError):
        return NotFoundError(str(exc))
    if isinstance(exc, StudyExistsError):
        return ConflictError(str(exc), field="name")
    if isinstance(exc, TrialStateError):
        return ConflictError(str(exc))
    return ApiError(str(exc))


def _loc(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


# Seconds a client waits before retrying a 503 (busy lock, database hiccup).
RETRY_AFTER_S = 2


def internal_error_body() -> dict[str, Any]:
    """The body of every 500: the documented shape, no exception text."""
    return _body("internal", INTERNAL_MESSAGE)


# Database errors that mean the storage cannot serve now (down, restarting, locked, out of
# connections): a 503 with Retry-After.  Every other SQLAlchemyError is a bug in spectune (500).
_UNAVAILABLE = (OperationalError, InterfaceError, DisconnectionError, PoolTimeoutError)


def storage_unavailable(exc: BaseException) -> bool:
    """Is `exc` the database being unreachable or busy (503), rather than a bug (500)?

    Optuna wraps its storage's errors in StorageInternalError; its cause decides.
    """
    if isinstance(exc, StorageInternalError):
        cause = exc.__cause__
        return cause is None or not isinstance(cause, SQLAlchemyError) or storage_unavailable(cause)
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, _UNAVAILABLE)


def _headers(exc: ApiError) -> dict[str, str] | None:
    if isinstance(exc, AuthError):
        return {"WWW-Authenticate": "Bearer"}
    if isinstance(exc, MethodNotAllowedError):
        return {"Allow": ", ".join(exc.allow)}
    if exc.status == 503:
        return {"Retry-After": str(RETRY_AFTER_S)}
    return None


# Reads a request's Authorization header and raises AuthError (or a 503) when it is no valid token:
# api.auth.authenticate.  Passed in, not imported: api.auth raises this module's errors.
Authenticate = Callable[[Session, str | None], object]


def install_error_handlers(
    app: FastAPI,
    on_unhandled: Callable[[Request, Exception], None] | None = None,
    *,
    authenticate: Authenticate | None = None,
) -> None:
    """Map every error to the documented shape; `on_unhandled` is told of each unexpected one.

    `authenticate` checks the token of a request whose body could not be parsed, before the
    parser's complaint is answered (without it, that complaint is answered to anyone)."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(_body(exc.code, exc.message, exc.field), status_code=exc.status, headers=_headers(exc))

    @app.exception_handler(OptimizerError)
    async def _optimizer_error(request: Request, exc: OptimizerError) -> JSONResponse:
        return await _api_error(request, _from_optimizer(exc))

    # The configuration rules' error is the wire package's (spectune_protocol.errors), outside
    # the optimizer's hierarchy: mapped the same way.
    @app.exception_handler(SpecError)
    async def _spec_error(request: Request, exc: SpecError) -> JSONResponse:
        return await _api_error(request, _from_optimizer(exc))

    async def _unauthenticated(request: Request) -> JSONResponse | None:
        """401 for a caller without a valid token, or None.

        FastAPI parses a JSON body before it resolves dependencies, so a body that is not JSON
        was answered 422 before the token was looked at: anyone could probe the API's parser.
        The token is checked here first for such bodies (valid JSON reaches the dependencies,
        which check the token before the fields).
        """
        ctx = getattr(request.app.state, "ctx", None)
        if ctx is None or authenticate is None or not request.url.path.startswith("/v1/"):
            return None
        check_token = authenticate

        def check() -> None:
            with ctx.sessions() as s:
                check_token(s, request.headers.get("authorization"))

        try:
            await run_in_threadpool(check)
        except ApiError as e:  # AuthError (401), or a busy lock (503)
            return await _api_error(request, e)
        except (SQLAlchemyError, StorageInternalError) as e:
            # Raised inside a handler it would escape as a bare 500: the documented 503 (or the
            # 500 of a bug) comes from the same mapping every route's errors get.
            return await _db_error(request, e)
        return None

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors) and (denied := await _unauthenticated(request)):
            return denied
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
        field = _loc(first.get("loc", ()))
        msg = str(first.get("msg", "invalid value"))
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON: send a JSON object with Content-Type: application/json"
        else:
            message = f"{field}: {msg}"
        details = [{"field": _loc(e.get("loc", ())), "message": str(e.get("msg", ""))} for e in errors[:20]]
        return JSONResponse(_body("invalid", message, field, details=details), status_code=422)

    async def _db_error(request: Request, exc: Exception) -> JSONResponse:
        if not storage_unavailable(exc):
            # A misuse of the ORM or a constraint we did not expect is a bug, not an outage:
            # "retry shortly" would hide it behind the workers' retries.
            return await _unhandled(request, exc)
        # Never leak SQL or driver text to clients; the log keeps it.
        log.error("database error: %s", exc, exc_info=exc)
        return JSONResponse(
            _body("storage_unavailable", "the database is unavailable or busy; retry shortly"),
            status_code=503,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    app.add_exception_handler(SQLAlchemyError, _db_error)
    # Optuna wraps the database errors of its own storage in this.
    app.add_exception_handler(StorageInternalError, _db_error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:
            if denied := await _unauthenticated(request):
                return denied
            # FastAPI answers 400 when the body cannot be read as JSON at all, e.g. nested so
            # deeply that the parser gives up: to the client that is one more invalid body.
            message = "the request body could not be parsed: send a plain JSON object (not nested too deeply)"
            return JSONResponse(_body("invalid", message, "body"), status_code=422)
        code = _HTTP_CODES.get(exc.status_code, "internal" if exc.status_code >= 500 else "bad_request")
        return JSONResponse(
            _body(code, str(exc.detail)), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
        # Starlette's ServerErrorMiddleware calls this and then re-raises, so the server logs the
        # traceback; the client gets the documented shape only.
        log.error("unhandled error in %s %s: %r", request.method, request.url.path, exc)
        if on_unhandled is not None:
            try:
                on_unhandled(request, exc)
            except Exception:  # noqa: BLE001 - counting must never hide the answer
                log.exception("could not count an unhandled error")
        return JSONResponse(internal_error_body(), status_code=500)
