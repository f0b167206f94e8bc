"""The worker's client for the spectune lease API, over an injected `httpx.Client`.

Errors, by what the caller should do about them:

    ApiError
    ├── AuthError        401/403: the token is wrong or revoked; retrying cannot help, exit
    ├── LeaseLost        409/410: the lease is no longer ours; stop its work, report nothing
    ├── ApiRejected      any other 4xx: the API refused this request as malformed; log it loudly
    ├── ApiProtocolError a 2xx whose body does not match spectune_protocol/ (version skew)
    └── ApiUnavailable   connection errors, time-outs, 408/429/5xx still failing after the
                         retry window (or a stop was requested while waiting to retry)

Transient failures are retried with capped exponential back-off and jitter, waiting on the
injected `wait` (normally the worker's stop event, so a shutdown interrupts a back-off at once).
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from spectune_protocol import (
    STANDING_HEADER,
    CompleteIn,
    CompleteOut,
    HeartbeatOut,
    Inventory,
    LeaseOut,
    ProgressIn,
    ProgressOut,
    WorkerStanding,
)
from workers.errors import WorkerError

log = logging.getLogger("spectune.worker.client")

M = TypeVar("M", bound=BaseModel)

# Statuses worth retrying: the API (or a proxy in front of it) is busy, restarting or overloaded.
_TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


class ApiError(WorkerError):
    """Base of the client's errors."""


class AuthError(ApiError):
    """The API refused the worker's token (401/403)."""


class LeaseLost(ApiError):
    """The lease expired, was reclaimed, or belongs to another worker now (409/410)."""


class ApiRejected(ApiError):
    """A 4xx other than auth and lease loss: this request will never be accepted as it is."""

    def __init__(self, status: int, detail: str, what: str) -> None:
        super().__init__(f"{what}: API answered {status}: {detail}")
        self.status = status
        self.detail = detail


class ApiProtocolError(ApiError):
    """The API answered 2xx with a body this worker cannot read (API and worker versions differ)."""


class LeaseUnreadable(ApiProtocolError):
    """A lease whose id could be read but not the rest: it is refused by id, never run."""

    def __init__(self, lease_id: str, message: str) -> None:
        super().__init__(message)
        self.lease_id = lease_id


class ApiUnavailable(ApiError):
    """The API could not be reached (or kept failing) within the retry window."""


@dataclass(frozen=True)
class Backoff:
    """Capped exponential back-off with jitter: attempt n waits about initial_s * factor**n.

    Jitter only shortens a delay (by up to `jitter` of it), so `max_s` is a hard cap and many
    workers restarted together do not retry in lock-step.
    """

    initial_s: float = 1.0
    factor: float = 2.0
    max_s: float = 60.0
    jitter: float = 0.25
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def delay(self, attempt: int) -> float:
        base = min(self.max_s, self.initial_s * self.factor ** min(attempt, 64))
        return base * (1.0 - self.jitter * self.rng.random())


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason_phrase
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])[:500]
    return str(body)[:500]


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: rare from our API, and the back-off covers it


def _standing_of(resp: httpx.Response) -> WorkerStanding | None:
    """The fleet's decisions about this worker from a lease answer's header; None when absent or
    unreadable (an older API): the worker then logs nothing about them, and works as before."""
    raw = resp.headers.get(STANDING_HEADER)
    if raw is None:
        return None
    try:
        return WorkerStanding.model_validate_json(raw)
    except ValueError:
        log.warning("the API's %s header is unreadable; ignored", STANDING_HEADER)
        return None


class ApiClient:
    """Typed calls of the lease protocol.  Thread-safe (httpx.Client is) for the heartbeat thread.

    `wait(seconds)` sleeps between retries and returns True when the worker is stopping, which
    ends the retries early with ApiUnavailable.  `retry_for_s` bounds how long one call keeps
    retrying transient failures (each call can override it).
    """

    def __init__(
        self,
        http: httpx.Client,
        *,
        token: str,
        worker_id: str,
        backoff: Backoff | None = None,
        retry_for_s: float = 60.0,
        wait: Callable[[float], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._http = http
        self._auth = {"Authorization": f"Bearer {token}"}
        self._worker_id = worker_id
        self._backoff = backoff or Backoff()
        self._retry_for_s = retry_for_s
        self._wait = wait or threading.Event().wait
        self._clock = clock
        # What the fleet decided about this worker, from the last lease answer (None: not said).
        self.standing: WorkerStanding | None = None

    @property
    def worker_id(self) -> str:
        return self._worker_id

    def __repr__(self) -> str:  # never show the token
        return f"ApiClient(base_url={str(self._http.base_url)!r}, worker_id={self._worker_id!r})"

    # -- the protocol -------------------------------------------------------------------------

    def lease(self, inventory: Inventory, *, retry_for_s: float | None = None) -> LeaseOut | None:
        """Ask for work: a lease, or None when the API has none for this worker (204)."""
        path = f"/v1/workers/{quote(self._worker_id, safe='')}/lease"
        resp = self._request("POST", path, inventory, "lease", retry_for_s)
        self.standing = _standing_of(resp)
        if resp.status_code == 204:
            return None
        try:
            return self._parse(resp, LeaseOut, "lease")
        except ApiProtocolError as e:
            lease_id = _lease_id_of(resp)
            if lease_id is None:
                raise
            raise LeaseUnreadable(lease_id, str(e)) from e

    def heartbeat(self, lease_id: str, *, retry_for_s: float | None = None) -> HeartbeatOut:
        resp = self._request("POST", self._lease_path(lease_id, "heartbeat"), None, "heartbeat", retry_for_s)
        return self._parse(resp, HeartbeatOut, "heartbeat")

    def progress(self, lease_id: str, body: ProgressIn, *, retry_for_s: float | None = None) -> ProgressOut:
        path = self._lease_path(lease_id, "progress")
        resp = self._request("POST", path, body, "progress", retry_for_s)
        return self._parse(resp, ProgressOut, "progress")

    def complete(self, lease_id: str, body: CompleteIn, *, retry_for_s: float | None = None) -> CompleteOut:
        """Report a lease's outcome.  Idempotent on the API side, so a retry after a lost answer is safe."""
        path = self._lease_path(lease_id, "complete")
        resp = self._request("POST", path, body, "complete", retry_for_s)
        return self._parse(resp, CompleteOut, "complete")

    # -- plumbing -----------------------------------------------------------------------------

    @staticmethod
    def _lease_path(lease_id: str, action: str) -> str:
        return f"/v1/leases/{quote(lease_id, safe='')}/{action}"

    def _request(
        self, method: str, path: str, body: BaseModel | None, what: str, retry_for_s: float | None
    ) -> httpx.Response:
        # Every body is a protocol model, written as JSON once (the same text on every retry).
        json_body = None if body is None else body.model_dump(mode="json")
        window = self._retry_for_s if retry_for_s is None else retry_for_s
        deadline = self._clock() + window
        attempt = 0
        while True:
            try:
                resp = self._http.request(method, path, json=json_body, headers=self._auth)
            except httpx.TransportError as e:
                problem, hint = f"{type(e).__name__}: {e}", None
            else:
                status = resp.status_code
                if status < 300:
                    return resp
                if status < 400:
                    where = resp.headers.get("location", "?")
                    raise ApiRejected(status, f"redirected to {where}; set api_url to the final URL", what)
                if status in (401, 403):
                    raise AuthError(
                        f"{what}: the API refused the worker token ({status}: {_detail(resp)}); "
                        "check token_file holds a valid token with the 'worker' role"
                    )
                if status in (409, 410):
                    raise LeaseLost(f"{what}: lease no longer held by this worker ({status}: {_detail(resp)})")
                if status not in _TRANSIENT_STATUSES:
                    raise ApiRejected(status, _detail(resp), what)
                problem, hint = f"HTTP {status}: {_detail(resp)}", _retry_after(resp)
            delay = self._backoff.delay(attempt)
            if hint is not None:
                delay = max(delay, min(hint, self._backoff.max_s))
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise ApiUnavailable(f"{what}: API unavailable after {attempt + 1} attempt(s): {problem}")
            delay = min(delay, remaining)
            log.warning("%s: %s; retry %d in %.1f s", what, problem, attempt + 1, delay)
            if self._wait(delay):
                raise ApiUnavailable(f"{what}: stopping while the API was unavailable: {problem}")
            attempt += 1

    @staticmethod
    def _parse(resp: httpx.Response, model: type[M], what: str) -> M:
        try:
            return model.model_validate_json(resp.content)
        except ValidationError as e:
            first = e.errors()[0]
            # The field's name, never its value: the value came from the API and is not trusted.
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise ApiProtocolError(
                f"{what}: the API's answer does not match this worker's protocol (upgrade spectune on "
                f"one side): {e.error_count()} error(s), first: {where}: {first['msg']}"
            ) from e


def _lease_id_of(resp: httpx.Response) -> str | None:
    """The lease id of an answer that is not a valid lease, if it has a plausible one."""
    try:
        raw = resp.json()
    except ValueError:
        return None
    lease_id = raw.get("lease_id") if isinstance(raw, dict) else None
    if isinstance(lease_id, str) and re.fullmatch(r"[0-9a-f-]{36}", lease_id):
        return lease_id
    return None


def make_http_client(base_url: str, *, timeout_s: float, transport: httpx.BaseTransport | None = None) -> httpx.Client:
    """The httpx.Client the worker uses: base URL and time-outs (proxies and CAs from the environment)."""
    return httpx.Client(
        base_url=base_url,
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
        transport=transport,
        # A redirect could carry the bearer token to another host: treat it as an error instead.
        follow_redirects=False,
    )
