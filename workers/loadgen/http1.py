"""The fast path: stream SSE answers from a local HTTP/1.1 server inside an asyncio Protocol.

Why not plain httpx: with httpx's default transport (httpcore + h11 + anyio) every streamed
event costs ~150-200 us of CPU, so one core consumes only ~6k one-token events/s - about what an
engine produces at high concurrency, so the generator would distort what it measures.  Here the
socket's ``data_received`` callback decodes the chunked body, splits SSE events and hands each
``data`` payload, with its arrival time, straight to the caller's callback: no task switch, no
async-generator chain per event.  benchmarks/README.md ("Load generator capacity") has numbers.

Scope, on purpose: ``POST`` of a JSON body over plain ``http://`` to a server on this host,
HTTP/1.1 keep-alive, chunked / Content-Length / close-delimited response bodies.  No TLS,
proxies, redirects or compression (the engine is local and SGLang sends none of these).
Errors are raised as httpx exceptions so callers handle both paths the same way.

``LoadgenClient`` is an ``httpx.AsyncClient`` that carries such a streamer: the load generator
uses the fast path when given one, and plain httpx streaming for any other client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from time import perf_counter
from types import TracebackType
from typing import Any, cast
from urllib.parse import urlsplit

import httpx

from workers.loadgen.chunked import ChunkedDecoder, ChunkedError
from workers.loadgen.sse import SSEDecodeError, SSEDecoder

# Connecting to a local server should be quick; a hung connect should not wait the whole
# request time-out.
CONNECT_TIMEOUT_S = 30.0
# A response head larger than this is not SGLang's (its heads are a few hundred bytes).
MAX_HEAD_BYTES = 64 * 1024
# How much of a non-200 body is kept for the error message.
ERROR_BODY_BYTES = 2000

EventCallback = Callable[[bytes, float], None]
"""Called with each SSE ``data`` payload and its arrival time (``time.perf_counter()``)."""


class _Exchange:
    """One request/response on a connection: parses the answer as bytes arrive."""

    __slots__ = ("on_event", "done", "status", "error_body", "_head", "_chunked", "_remaining", "_sse", "received")

    def __init__(self, on_event: EventCallback, done: asyncio.Future[None]) -> None:
        self.on_event = on_event
        self.done = done
        self.status = 0
        self.error_body = bytearray()
        self.received = False
        self._head = b""
        self._chunked: ChunkedDecoder | None = None
        self._remaining: int | None = None  # Content-Length bytes still to come; None: until close
        self._sse = SSEDecoder()

    def feed(self, data: bytes, now: float) -> bool:
        """Consume bytes; return True when the response is complete."""
        self.received = True
        if not self.status:
            head = self._head + data
            end = head.find(b"\r\n\r\n")
            if end < 0:
                if len(head) > MAX_HEAD_BYTES:
                    raise httpx.RemoteProtocolError(f"response head larger than {MAX_HEAD_BYTES} bytes")
                self._head = head
                return False
            self._parse_head(head[:end])
            data = head[end + 4 :]
            if self._remaining == 0:
                return True
            if not data:
                return False
        if self._chunked is not None:
            payload = self._chunked.feed(data)
            complete = self._chunked.done
        else:
            payload = data
            if self._remaining is not None:
                self._remaining -= len(data)
                complete = self._remaining <= 0
            else:
                complete = False
        if payload:
            if self.status == 200:
                for event in self._sse.feed(payload):
                    self.on_event(event, now)
            elif len(self.error_body) < ERROR_BODY_BYTES:
                self.error_body += payload[: ERROR_BODY_BYTES - len(self.error_body)]
        if complete:
            self.finish_at_eof(now)
        return complete

    def finish_at_eof(self, now: float) -> None:
        """The body ended: deliver a last event that lacked its blank line."""
        if self.status == 200:
            for event in self._sse.close():
                self.on_event(event, now)

    @property
    def delimited_by_close(self) -> bool:
        return self.status != 0 and self._chunked is None and self._remaining is None

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise httpx.RemoteProtocolError(f"not an HTTP/1.x response: {lines[0][:100]!r}")
        status = int(parts[1])
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = ChunkedDecoder()
            elif name == b"content-length":
                self._remaining = int(value)
            elif name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
                raise httpx.DecodingError(f"unexpected Content-Encoding {value.strip()!r} (the request asked for none)")
        if 100 <= status < 200:
            raise httpx.RemoteProtocolError(f"unexpected interim response {status}")
        if status in (204, 304):
            self._remaining = 0
        if self._chunked is not None:
            self._remaining = None
        self.status = status


# Receive buffer per connection.  A BufferedProtocol lets the loop recv_into() this buffer;
# a plain Protocol makes asyncio allocate a fresh 256 KiB bytes object for every recv(), which
# costs more than parsing the event it carries.
RECV_BUFFER_BYTES = 64 * 1024


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection; at most one exchange at a time."""

    def __init__(self) -> None:
        self._buffer = bytearray(RECV_BUFFER_BYTES)
        self._view = memoryview(self._buffer)
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.closed = False
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses but have the same methods.
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        data = bytes(self._view[:nbytes])
        ex = self.exchange
        if ex is None or ex.done.done():
            # Bytes nobody asked for: the connection is out of step; never reuse it.
            self.keep_alive = False
            if self.transport is not None:
                self.transport.close()
            return
        try:
            complete = ex.feed(data, perf_counter())
        except BaseException as e:  # the callback's LoadgenError too: fail this request only
            self.keep_alive = False
            if isinstance(e, ChunkedError | SSEDecodeError):
                e = httpx.RemoteProtocolError(str(e))
            ex.done.set_exception(e)
            if self.transport is not None:
                self.transport.close()
            return
        if complete:
            ex.done.set_result(None)

    def eof_received(self) -> bool | None:
        return None  # let the transport close; connection_lost decides what it means

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        ex = self.exchange
        if ex is None or ex.done.done():
            return
        if ex.delimited_by_close and exc is None:
            try:
                ex.finish_at_eof(perf_counter())
            except BaseException as e:
                ex.done.set_exception(e)
                return
            ex.done.set_result(None)
            return
        detail = f" ({exc})" if exc else ""
        if ex.status:
            message = "peer closed connection without sending complete message body" + detail
        else:
            message = "the server closed the connection before answering" + detail
        ex.done.set_exception(httpx.RemoteProtocolError(message))

    def reusable(self) -> bool:
        return self.keep_alive and not self.closed and self.transport is not None and not self.transport.is_closing()

    def abort(self) -> None:
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()


class SSEStreamer:
    """POSTs JSON to a local HTTP/1.1 server and feeds the SSE events of the answer to a callback."""

    def __init__(self, connect_timeout_s: float = 30.0) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def post(self, url: str, body: bytes, on_event: EventCallback) -> tuple[int, bytes]:
        """Send the request; call ``on_event`` for each event as it arrives.

        Returns (status, first bytes of the body when the status is not 200).  Raises
        httpx.ConnectError / ConnectTimeout / RemoteProtocolError, or whatever ``on_event``
        raised.  The caller bounds the whole call with its own deadline; if the call is cancelled
        the connection is dropped.
        """
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise httpx.UnsupportedProtocol(f"the fast path speaks plain http:// to a local engine, not {url!r}")
        key = (parts.hostname, parts.port or 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        message = (
            f"POST {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nAccept-Encoding: identity\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1") + body
        loop = asyncio.get_running_loop()
        for attempt in range(2):  # a reused keep-alive connection may have been closed by the server
            conn, reused = await self._acquire(key)
            ex = _Exchange(on_event, loop.create_future())
            conn.exchange = ex
            try:
                assert conn.transport is not None
                conn.transport.write(message)
                await ex.done
            except httpx.RemoteProtocolError:
                conn.abort()
                if reused and not ex.received and attempt == 0:
                    continue
                raise
            except BaseException:  # an event callback's error, cancellation, time-out
                conn.abort()
                raise
            conn.exchange = None
            if ex.status == 200 and conn.reusable():
                self._idle.setdefault(key, []).append(conn)
            else:
                conn.abort()
            return ex.status, bytes(ex.error_body)
        raise AssertionError("unreachable: the second attempt returns or raises")

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()

    async def _acquire(self, key: tuple[str, int]) -> tuple[_Connection, bool]:
        idle = self._idle.get(key)
        while idle:  # bounded by the number of idle connections
            conn = idle.pop()
            if conn.reusable():
                return conn, True
            conn.abort()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(_Connection, key[0], key[1])
        except TimeoutError as e:
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from e
        except OSError as e:
            raise httpx.ConnectError(f"cannot connect to {key[0]}:{key[1]}: {e}") from e
        return conn, False


class LoadgenClient(httpx.AsyncClient):
    """An httpx client that also carries the fast SSE path (``self.sse``) for ``/generate``."""

    def __init__(self, *, connect_timeout_s: float = 30.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sse = SSEStreamer(connect_timeout_s)

    async def aclose(self) -> None:
        self.sse.close()
        await super().aclose()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        self.sse.close()
        await super().__aexit__(exc_type, exc_value, traceback)


def make_client(request_timeout_s: float = 600.0) -> LoadgenClient:
    """The client ``run_workload`` uses: an httpx client carrying the fast SSE path.

    ``trust_env=False``: the engine is on this host, so an HTTP(S)_PROXY meant for the API must
    not route benchmark traffic through a proxy.
    """
    connect_s = min(CONNECT_TIMEOUT_S, request_timeout_s)
    timeout = httpx.Timeout(request_timeout_s, connect=connect_s)
    return LoadgenClient(connect_timeout_s=connect_s, timeout=timeout, trust_env=False)
