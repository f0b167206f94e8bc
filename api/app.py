"""The FastAPI application factory.

Routes, in the order they match: `/healthz`, `/v1/...` (the API), `/docs` and `/openapi.json`,
`/login` and `/logout`, `/metrics`, then optuna-dashboard mounted at `/` behind `DashboardGate`
(it must sit at the root: docs/optuna.md §7).
"""

from __future__ import annotations

import functools
import gc
import json
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.routing import iter_route_contexts
from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

from api import schema
from api.auth import authenticate
from api.context import ServiceContext
from api.dashboard import DashboardGate, login_router
from api.errors import ERROR_RESPONSES, MethodNotAllowedError, NotFoundError, install_error_handlers
from api.limits import BodyLimitMiddleware
from api.metrics import ApiMetrics, metrics_router
from api.routes import fleet, leases, studies
from api.sessions import SessionKeeper, load_secret
from api.settings import Settings, get_settings

API_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def install_unknown_api_paths(app: FastAPI) -> None:
    """Answer unknown `/v1` paths (and known ones with another method) in the API's error shape.

    Without this they would fall through to the dashboard mounted at `/`, which answers an API
    client with HTML or a dashboard permission error.  Registered after every API router, so it
    only sees what no route claimed.
    """

    catch_all = ("/v1", "/v1/{rest:path}")

    def unknown(request: Request) -> None:
        path = request.url.path
        allow = sorted({method for regex, methods in api_routes() if regex.match(path) for method in methods})
        if allow:
            raise MethodNotAllowedError(
                f"{request.method} is not allowed on {path}; use {', '.join(allow)}", allow=allow
            )
        raise NotFoundError(f"no API endpoint {path}; the endpoints are listed at /docs")

    @functools.cache
    def api_routes() -> list[tuple[re.Pattern[str], frozenset[str]]]:
        # FastAPI keeps included routers nested; iter_route_contexts walks them.
        found = []
        for route in iter_route_contexts(app.routes):
            path, methods = getattr(route, "path", None), getattr(route, "methods", None)
            if path and methods and path.startswith("/v1/") and path not in catch_all:
                found.append((compile_path(path)[0], frozenset(methods)))
        return found

    for path in catch_all:
        app.add_api_route(path, unknown, methods=API_METHODS, include_in_schema=False)


HEALTHY = {"status": "ok"}
GIL_SWITCH_INTERVAL_S = 0.001


class HealthzFirst:
    """Answers `GET/HEAD /healthz` on the event loop, before every other layer.

    A sync handler waited for a thread of the pool, and under load (every thread busy with
    leases) a probe took up to 20 s and the host was restarted for being slow, not dead.  Even
    as an async route a probe passed the timing middleware (several turns of the loop, each
    waiting for the GIL behind 40 request threads).  Here it is one turn: no thread, no
    database round trip, nothing else to wait for.
    """

    _BODY = json.dumps(HEALTHY).encode()
    _HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(_BODY)).encode())]

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/healthz" or scope["method"] not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": self._HEADERS})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else self._BODY})


def create_app_in_worker() -> FastAPI:
    """The app of one of `spectune server --workers N`'s processes: its settings from the
    environment (the supervisor put the database URL there); it stops when the supervisor is gone."""
    from workers.lifeline import exit_with_parent

    exit_with_parent()
    return freeze_startup_heap(create_app())


def freeze_startup_heap(app: FastAPI) -> FastAPI:
    """Takes every object alive now (modules, Optuna, SQLAlchemy, pydantic, scipy) out of the
    cyclic garbage collector's scans.  A full collection holds the GIL: under 300 studies and 40
    clients they took 260-1080 ms each, every event-loop turn (and /healthz) waited them out,
    and they were the whole tail of the probe's latency.  Frozen, 120-170 ms.  A server calls
    this once, before it serves; the objects it freezes live as long as the process anyway."""
    gc.collect()
    gc.freeze()
    return app


def create_app(settings: Settings | None = None, *, check_schema: bool = True) -> FastAPI:
    settings = settings or get_settings()
    # The collector reads the context the lifespan opens (`app` is bound below, before any scrape).
    metrics = ApiMetrics(lambda: getattr(app.state, "ctx", None))
    dashboard = DashboardGate(on_error=metrics.count_dashboard_error)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The event loop (where /healthz answers) competes for the GIL with up to 40 request
        # threads; CPython hands the GIL over every 5 ms by default, 1 ms here, so a probe
        # waits less behind threads busy in Python.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        # Two small pools of request threads: the protocol's calls (api/routes/leases.py), which
        # may wait on a study's lock, and everything else.  Every runnable thread competes with
        # the event loop for the GIL, so fewer threads answer /healthz sooner; apart, reads never
        # queue behind reports waiting for a lock.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.request_threads
        app.state.protocol_threads = anyio.CapacityLimiter(settings.protocol_threads)
        ctx = ServiceContext.open(settings)
        if check_schema:
            try:
                schema.check_current(ctx.engine)
            except Exception:
                ctx.close()
                raise
        try:
            keeper = SessionKeeper(load_secret(settings))
        except (OSError, ValueError):
            ctx.close()
            raise
        app.state.ctx = ctx
        app.state.sessions = keeper
        dashboard.open(ctx, keeper)
        try:
            yield
        finally:
            dashboard.close()
            ctx.close()

    app = FastAPI(
        title="spectune",
        version="0.1.0",
        summary="Bayesian tuning of SGLang EAGLE-3 speculative decoding",
        lifespan=lifespan,
        # Every error body is ours ({"error": {...}, "detail": ...}); say so in the schema.
        responses=ERROR_RESPONSES,
    )
    install_error_handlers(app, on_unhandled=metrics.count_unhandled, authenticate=authenticate)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness: open, no token needed, reveals nothing.

        Answered by `HealthzFirst` before any middleware (this route documents it).
        """
        return HEALTHY

    app.include_router(studies.router)
    app.include_router(leases.router)
    app.include_router(fleet.router)
    install_unknown_api_paths(app)
    app.include_router(login_router())
    app.include_router(metrics_router(metrics))
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    # Outermost, so the latency includes the body-limit check and every route.
    metrics.install(app)
    # Outermost of all: a probe never waits for a thread, the database or another middleware.
    app.add_middleware(HealthzFirst)
    # Last: everything no route above claims goes to the dashboard, which checks the caller.
    app.mount("/", dashboard)
    return app
