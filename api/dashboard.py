"""optuna-dashboard inside the API process, behind spectune's tokens, read-only.

optuna-dashboard has no authentication and exposes destructive endpoints (delete study, tell,
user-attr and note edits, artifact upload/delete, `POST /incompatible-rdb-schema`).  A sub-path
mount is broken (its page loads `/static/...` and calls `/api/...` at the root), so it is
mounted at `/` after our own routes (`/v1`, `/healthz`, `/docs`, `/login`, `/metrics` win) and
every request to it passes `DashboardGate`:

* who: a bearer token (`Authorization: Bearer ...`) or the session cookie set by `/login`; the
  role must be `user` or `admin` (a worker token may only lease and report).  Without either
  the answer is 401 (HTML requests get a page that leads to `/login`, still with status 401).
* what: GET and HEAD only, for every role, admin included.  Telling a trial or deleting a study
  behind the lease service's back would leave leases and spectune's tables inconsistent; the
  API and the CLI are the way to change things.  Anything else is answered 403.

Sessions are server-side records (api.sessions): the cookie is a random id with an HMAC under a
secret the database never holds; `/logout` and token revocation end a session for good.

optuna-dashboard reads `Accept-Encoding` without a default and fails (500) on a request without
one (a proxy or a plain client); the gate supplies `identity` in that case.
"""

from __future__ import annotations

import html
import json
import logging
import re
from collections.abc import Callable, Iterable
from typing import cast
from urllib.parse import parse_qs, quote, urlsplit

import optuna_dashboard
from a2wsgi import WSGIMiddleware
from a2wsgi.wsgi_typing import Environ, StartResponse
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import dashboard_readonly as readonly
from api.artifacts import make_artifact_store
from api.auth import Principal, authenticate
from api.context import ServiceContext
from api.errors import AuthError, ForbiddenError, internal_error_body
from api.notes import refresh_study_note
from api.sessions import SESSION_TTL_S, SessionKeeper

log = logging.getLogger("spectune.api.dashboard")

SESSION_COOKIE = "spectune_session"
VIEW_ROLES = ("user", "admin")
SAFE_METHODS = ("GET", "HEAD")
DEFAULT_NEXT = "/dashboard"
_STUDY_API = re.compile(r"/api/studies/([0-9]{1,18})\Z")


# ---------------------------------------------------------------------------------------- sessions


def viewer(ctx: ServiceContext, keeper: SessionKeeper, authorization: str | None, cookie: str | None) -> Principal:
    """Who is asking, from the bearer header (preferred) or the session cookie; must may view."""
    if authorization:
        with ctx.sessions() as s:
            principal = authenticate(s, authorization)
    elif cookie:
        principal = keeper.principal(ctx.sessions, cookie)
    else:
        raise AuthError("sign in at /login, or send 'Authorization: Bearer <token>'")
    if principal.role not in VIEW_ROLES:
        raise ForbiddenError(f"a {principal.role} token may not view the dashboard; use a user or admin token")
    return principal


# ---------------------------------------------------------------------------------------- the gate


class DashboardGate:
    """ASGI app mounted at `/`: authenticates, allows reads only, then runs optuna-dashboard.

    The dashboard needs the process's Optuna storage, which exists only once the lifespan has
    opened the ServiceContext: `open(ctx)` builds it, `close()` drops it.
    """

    def __init__(self, on_error: Callable[[str, int], None] | None = None) -> None:
        self._ctx: ServiceContext | None = None
        self._keeper: SessionKeeper | None = None
        self._app: ASGIApp | None = None
        # Told (method, status) of every 5xx optuna-dashboard answers, which the gate replaces.
        self._on_error = on_error

    def open(self, ctx: ServiceContext, keeper: SessionKeeper) -> None:
        store = make_artifact_store(ctx.settings.artifact_dir)
        wsgi = optuna_dashboard.wsgi(ctx.storage, artifact_store=store)
        self._ctx, self._keeper = ctx, keeper
        self._app = cast(ASGIApp, WSGIMiddleware(_NoteRefresher(wsgi, ctx), workers=4))

    def close(self) -> None:
        self._ctx, self._keeper, self._app = None, None, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._ctx is None or self._keeper is None or self._app is None:
            message = "the dashboard is not available"
            await _send(send, 503, _json_error("storage_unavailable", message), "application/json")
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            await run_in_threadpool(viewer, self._ctx, self._keeper, headers.get("authorization"), _cookie(headers))
        except AuthError as e:
            await self._unauthorized(scope, headers, send, e.message)
            return
        except ForbiddenError as e:
            await _send(send, 403, _json_error("forbidden", e.message), "application/json")
            return
        if scope["method"] not in SAFE_METHODS:
            message = (
                f"{scope['method']} {scope['path']}: the dashboard is read-only through spectune; "
                "change studies with the API or `spectune study ...`"
            )
            await _send(send, 403, _json_error("forbidden", message), "application/json")
            return
        problem = _bad_query(scope)
        if problem is not None:
            status, code, message = problem
            await _send(send, status, _json_error(code, message), "application/json")
            return
        if scope["method"] == "GET" and scope["path"] == readonly.SCRIPT_PATH:
            await _send(send, 200, readonly.SCRIPT.encode(), "text/javascript; charset=utf-8")
            return
        if "accept-encoding" not in headers:
            # optuna-dashboard's static routes read the header without a default (KeyError, 500).
            scope = {**scope, "headers": [*scope["headers"], (b"accept-encoding", b"identity")]}
        out = self._hide_errors(scope, send)
        if scope["method"] == "GET" and scope["path"].startswith("/dashboard"):
            out = _readonly_page(out)
        await self._app(scope, receive, out)

    def _hide_errors(self, scope: Scope, send: Send) -> Send:
        """optuna-dashboard's framework answers its own exceptions with an HTML 500 page; send the
        documented 500 body instead (the traceback, if any, stays in the log) and count it."""
        failed = False

        async def guarded(message: Message) -> None:
            nonlocal failed
            if message["type"] == "http.response.start" and message["status"] >= 500:
                failed = True
                log.error("optuna-dashboard answered %d to %s %s", message["status"], scope["method"], scope["path"])
                if self._on_error is not None:
                    self._on_error(scope["method"], message["status"])
                body = json.dumps(internal_error_body()).encode()
                await _send(send, 500, body, "application/json")
                return
            if failed:
                return  # the dashboard's own body: dropped
            await send(message)

        return guarded

    @staticmethod
    async def _unauthorized(scope: Scope, headers: dict[str, str], send: Send, message: str) -> None:
        if scope["method"] == "GET" and "text/html" in headers.get("accept", ""):
            target = scope["path"] + ("?" + scope["query_string"].decode("latin-1") if scope["query_string"] else "")
            login = "/login?next=" + quote(target, safe="")
            page = _page(
                "Sign in required",
                f'<meta http-equiv="refresh" content="0; url={html.escape(login)}">'
                f'<p>{html.escape(message)}</p><p><a href="{html.escape(login)}">Sign in</a></p>',
            )
            await _send(send, 401, page.encode(), "text/html; charset=utf-8", bearer=True)
            return
        await _send(send, 401, _json_error("unauthorized", message), "application/json", bearer=True)


def _readonly_page(send: Send) -> Send:
    """Sends optuna-dashboard's HTML page with the read-only additions (api.dashboard_readonly);
    anything else passes as it is."""
    start: Message | None = None
    body = b""

    async def rewrite(message: Message) -> None:
        nonlocal start, body
        if message["type"] == "http.response.start":
            types = [v for k, v in message.get("headers", []) if k.lower() == b"content-type"]
            if not any(t.startswith(b"text/html") for t in types):
                await send(message)
                return
            start = message
            return
        if start is None or message["type"] != "http.response.body":
            await send(message)
            return
        body += message.get("body", b"")
        if message.get("more_body", False):
            return
        page = readonly.inject(body)
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(page)).encode())]})
        await send({"type": "http.response.body", "body": page})

    return rewrite


class _NoteRefresher:
    """WSGI wrapper: before the dashboard serves a study, bring its note up to date."""

    def __init__(self, app: Callable[[Environ, StartResponse], Iterable[bytes]], ctx: ServiceContext) -> None:
        self._app = app
        self._ctx = ctx

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        match = _STUDY_API.match(environ.get("PATH_INFO", "").rstrip("/"))
        if match and environ.get("REQUEST_METHOD") == "GET":
            try:
                name = self._ctx.storage.get_study_name_from_id(int(match.group(1)))
                refresh_study_note(self._ctx, name)
            except Exception as e:  # noqa: BLE001 - a stale note must never break the page
                log.warning("could not refresh the note of study id %s: %s", match.group(1), e)
        result: Iterable[bytes] = self._app(environ, start_response)
        return result


# optuna-dashboard parses these with int() and answers anything else with a 500 (`?after=abc`),
# and an id beyond 64 bits reaches the database as an overflow; checked here first.
_ID_IN_PATH = re.compile(r"/(?:api/studies|api/trials|csv|artifacts)/([0-9]+)(?:/|\Z)")
_MAX_ID_DIGITS = 18


def _bad_query(scope: Scope) -> tuple[int, str, str] | None:
    """(status, code, message) for a dashboard request optuna-dashboard would answer with a 500."""
    match = _ID_IN_PATH.match(scope["path"])
    if match and len(match.group(1)) > _MAX_ID_DIGITS:
        return 404, "not_found", f"no study or trial with id {match.group(1)[:24]}..."
    if _STUDY_API.match(scope["path"].rstrip("/")):
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        for value in query.get("after", []):
            if not (value.isascii() and value.isdigit() and len(value) <= _MAX_ID_DIGITS):
                message = f"after: {value[:40]!r} is not a trial count; send a whole number >= 0, e.g. ?after=0"
                return 422, "invalid", message
    return None


def _cookie(headers: dict[str, str]) -> str | None:
    for part in headers.get("cookie", "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == SESSION_COOKIE and value:
            return value
    return None


def _json_error(code: str, message: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message}, "detail": message}).encode()


async def _send(send: Send, status: int, body: bytes, content_type: str, *, bearer: bool = False) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    if bearer:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------------------------------- login


def _page(title: str, body: str) -> str:
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)} · spectune</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; background: #f4f5f7; margin: 0; }}
main {{ max-width: 26rem; margin: 12vh auto; background: #fff; padding: 2rem; border-radius: 8px;
        box-shadow: 0 1px 4px rgba(0,0,0,.15); }}
h1 {{ font-size: 1.3rem; margin-top: 0; }}
input[type=password] {{ width: 100%; box-sizing: border-box; padding: .55rem; font-family: monospace; }}
button {{ margin-top: 1rem; padding: .5rem 1.2rem; }}
.error {{ color: #b00020; }}
.hint {{ color: #555; font-size: .9rem; }}
</style></head><body><main>{body}</main></body></html>"""


def _foreign_origin(request: Request) -> str | None:
    """The origin a browser says a POST came from, when it is not this site (else None).

    `Origin` (every current browser sends it on a POST), else `Referer`; a request with neither
    is not from a browser's cross-site form (curl, scripts) and is let through.  Hosts are
    compared (host:port), not schemes, so a TLS-terminating proxy in front does not break it.
    """
    host = request.headers.get("host", "").lower()
    origin = request.headers.get("origin")
    if origin is not None:
        if origin == "null" or urlsplit(origin).netloc.lower() != host:
            return origin
        return None
    referer = request.headers.get("referer")
    if referer is not None and urlsplit(referer).netloc.lower() != host:
        return referer
    return None


def _safe_next(value: str | None) -> str:
    # Only same-site paths: an open redirect would turn the login page into a phishing aid.
    if value and value.startswith("/") and not value.startswith("//") and "\\" not in value:
        return value
    return DEFAULT_NEXT


def login_page(next_path: str, error: str | None = None) -> str:
    err = f'<p class="error">{html.escape(error)}</p>' if error else ""
    return _page(
        "Sign in",
        f"""<h1>spectune dashboard</h1>{err}
<form method="post" action="/login">
<label for="token">API token (role user or admin)</label>
<input type="password" id="token" name="token" autocomplete="off" autofocus required>
<input type="hidden" name="next" value="{html.escape(next_path)}">
<button type="submit" id="sign-in">Sign in</button>
</form>
<p class="hint">Create one with <code>spectune token create --role user</code>.
The session lasts {SESSION_TTL_S // 3600} h; <a href="/logout">sign out</a>.</p>""",
    )


def login_router() -> APIRouter:
    router = APIRouter(tags=["dashboard"], include_in_schema=False)

    @router.get("/login")
    def show_login(next: str | None = None) -> HTMLResponse:
        return HTMLResponse(login_page(_safe_next(next)))

    @router.post("/login")
    async def do_login(request: Request) -> Response:
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        token = (form.get("token") or [""])[0].strip()
        next_path = _safe_next((form.get("next") or [""])[0])
        foreign = _foreign_origin(request)
        if foreign is not None:
            # Login CSRF: another site's page posting its own token would sign this browser in
            # as that token's owner.  The cookie is SameSite=Strict; this closes the sign-in.
            log.warning("dashboard sign-in refused: posted from %r", foreign[:200])
            message = "sign-in refused: the form was sent from another site; sign in from this page"
            return HTMLResponse(login_page(next_path, message), status_code=403)
        ctx: ServiceContext = request.app.state.ctx
        keeper: SessionKeeper = request.app.state.sessions
        try:
            principal = await run_in_threadpool(viewer, ctx, keeper, f"Bearer {token}" if token else None, None)
        except (AuthError, ForbiddenError) as e:
            status = 403 if isinstance(e, ForbiddenError) else 401
            return HTMLResponse(login_page(next_path, e.message), status_code=status)
        cookie = await run_in_threadpool(keeper.start, ctx.write_sessions, principal)
        response = RedirectResponse(next_path, status_code=303)
        response.set_cookie(
            SESSION_COOKIE,
            cookie,
            max_age=SESSION_TTL_S,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path="/",
        )
        log.info("dashboard sign-in: token %d (%s, %s)", principal.token_id, principal.name, principal.role)
        return response

    @router.api_route("/logout", methods=["GET", "POST"])
    def logout(request: Request) -> Response:
        cookie = request.cookies.get(SESSION_COOKIE)
        if cookie:
            # Ends the session for good: a copy of the cookie kept elsewhere no longer works.
            keeper: SessionKeeper = request.app.state.sessions
            keeper.end(request.app.state.ctx.write_sessions, cookie)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
        return response

    return router
