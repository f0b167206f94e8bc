"""The FastAPI application factory."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from api import schema
from api.context import ServiceContext
from api.errors import PayloadTooLargeError, install_error_handlers
from api.routes import fleet, leases, studies
from api.settings import Settings, get_settings


def create_app(settings: Settings | None = None, *, check_schema: bool = True) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx = ServiceContext.open(settings)
        if check_schema:
            try:
                schema.check_current(ctx.engine)
            except Exception:
                ctx.close()
                raise
        app.state.ctx = ctx
        try:
            yield
        finally:
            ctx.close()

    app = FastAPI(
        title="spectune",
        version="0.1.0",
        summary="Bayesian tuning of SGLang EAGLE-3 speculative decoding",
        lifespan=lifespan,
    )
    install_error_handlers(app)

    @app.middleware("http")
    async def limit_body(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            err = PayloadTooLargeError(f"request body over {settings.max_body_bytes} bytes")
            return JSONResponse({"error": {"code": err.code, "message": err.message}, "detail": err.message}, 413)
        return await call_next(request)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        """Liveness: open, no token needed, reveals nothing."""
        return {"status": "ok"}

    app.include_router(studies.router)
    app.include_router(leases.router)
    app.include_router(fleet.router)
    return app
