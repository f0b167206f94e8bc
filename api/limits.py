"""Request body limit, enforced before any route or the dashboard reads a byte too many."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import PayloadTooLargeError


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


async def _refuse(send: Send, max_bytes: int) -> None:
    # Answered here, before any route runs, in the same shape api.errors gives every error.
    err = PayloadTooLargeError(
        f"request body over {max_bytes} bytes; send less (SPECTUNE_MAX_BODY_BYTES sets the limit)"
    )
    body = json.dumps({"error": {"code": err.code, "message": err.message}, "detail": err.message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes`.

    A declared Content-Length is checked up front.  A chunked body (no length) is read here, up
    to the limit, and handed on whole: bodies we accept are small (≤ 1 MiB by default), and a
    client streaming more is refused after `max_bytes`, never read to its end.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                await _refuse(send, self.max_bytes)
                return
            await self.app(scope, receive, send)
            return
        if _header(scope, b"transfer-encoding") is None:
            await self.app(scope, receive, send)  # no body at all
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await _refuse(send, self.max_bytes)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)
