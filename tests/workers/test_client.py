"""The worker's API client over httpx.MockTransport: retries, back-off caps, 204, 409/410, 401."""

from __future__ import annotations

import json
import logging
import random
from datetime import UTC, datetime

import httpx
import pytest

from spectune_protocol import CompleteIn, Failure, Inventory, ProgressIn
from workers.client import (
    ApiClient,
    ApiProtocolError,
    ApiRejected,
    ApiUnavailable,
    AuthError,
    Backoff,
    LeaseLost,
    make_http_client,
)

TOKEN = "s3cr3t-token-value"

LEASE = {
    "lease_id": "L-1",
    "kind": "trial",
    "study": "demo",
    "trial_number": 3,
    "attempt": 1,
    "deadline": "2026-11-29T12:00:00Z",
    "heartbeat_interval_s": 10,
    "server": {"target": "llama", "draft": "eagle", "max_running_requests": 64},
    "workload": {"concurrency": [1, 8]},
}


class FakeClock:
    """Time that moves only when the client waits: back-off without real sleeping."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []
        self.stop_after: int | None = None

    def __call__(self) -> float:
        return self.now

    def wait(self, s: float) -> bool:
        self.waits.append(s)
        self.now += s
        return self.stop_after is not None and len(self.waits) >= self.stop_after


def make(handler, *, retry_for_s=60.0, backoff=None):
    clock = FakeClock()
    http = make_http_client("http://api.test", timeout_s=5, transport=httpx.MockTransport(handler))
    client = ApiClient(
        http,
        token=TOKEN,
        worker_id="host/1",
        backoff=backoff or Backoff(initial_s=1, max_s=8, rng=random.Random(7)),
        retry_for_s=retry_for_s,
        wait=clock.wait,
        clock=clock,
    )
    return client, clock


def inventory() -> Inventory:
    return Inventory(hostname="h", sglang_version="0.5.23", models=["llama"])


def test_lease_sends_inventory_and_token_and_parses_the_lease():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=LEASE)

    client, _ = make(handler)
    lease = client.lease(inventory())
    assert lease is not None and lease.lease_id == "L-1" and lease.server.target == "llama"
    (req,) = seen
    assert req.method == "POST" and req.url.raw_path == b"/v1/workers/host%2F1/lease"  # id quoted into one segment
    assert req.headers["authorization"] == f"Bearer {TOKEN}"
    assert json.loads(req.content)["models"] == ["llama"]
    assert TOKEN not in repr(client)


def test_204_means_no_work():
    client, clock = make(lambda r: httpx.Response(204))
    assert client.lease(inventory()) is None
    assert clock.waits == []


def test_connection_errors_and_5xx_are_retried_with_growing_capped_backoff():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) <= 3:
            raise httpx.ConnectError("connection refused", request=request)
        if len(calls) <= 7:
            return httpx.Response(503, json={"detail": "restarting"})
        return httpx.Response(200, json={"deadline": "2026-11-29T12:00:00Z"})

    client, clock = make(handler, retry_for_s=1000)
    out = client.heartbeat("L-1")
    assert out.deadline == datetime(2026, 11, 29, 12, tzinfo=UTC)
    assert len(calls) == 8 and len(clock.waits) == 7
    # Exponential (1, 2, 4, 8, 8, ...) shortened by at most 25 % jitter, never above the cap.
    for attempt, w in enumerate(clock.waits):
        nominal = min(8.0, 2.0**attempt)
        assert 0.75 * nominal <= w <= nominal
    assert max(clock.waits) <= 8.0


def test_retry_window_ends_in_api_unavailable():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    client, clock = make(handler, retry_for_s=20)
    with pytest.raises(ApiUnavailable, match="ReadTimeout"):
        client.progress("L-1", ProgressIn(step=0, concurrency=1, output_tok_s=10))
    assert sum(clock.waits) <= 20 and clock.now <= 20


def test_stop_request_interrupts_the_retries():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502)

    client, clock = make(handler, retry_for_s=1e9)
    clock.stop_after = 2
    with pytest.raises(ApiUnavailable, match="stopping"):
        client.lease(inventory())
    assert len(clock.waits) == 2


def test_retry_after_is_honoured_up_to_the_cap():
    answers = [httpx.Response(429, headers={"retry-after": "5"}), httpx.Response(429, headers={"retry-after": "999"})]

    def handler(request: httpx.Request) -> httpx.Response:
        return answers.pop(0) if answers else httpx.Response(204)

    client, clock = make(handler)
    assert client.lease(inventory()) is None
    assert clock.waits[0] >= 5 and clock.waits[1] == 8.0


@pytest.mark.parametrize("status", [401, 403])
def test_bad_token_is_not_retried(status):
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(status, json={"detail": "invalid token"})

    client, clock = make(handler)
    with pytest.raises(AuthError, match="token_file") as err:
        client.lease(inventory())
    assert len(calls) == 1 and clock.waits == []
    assert TOKEN not in str(err.value)


@pytest.mark.parametrize("status", [409, 410])
def test_lost_lease(status):
    client, clock = make(lambda r: httpx.Response(status, json={"detail": "lease expired"}))
    with pytest.raises(LeaseLost, match="lease expired"):
        client.heartbeat("L-1")
    assert clock.waits == []


def test_other_4xx_is_rejected_with_the_detail():
    client, _ = make(lambda r: httpx.Response(422, json={"detail": [{"msg": "field required"}]}))
    report = CompleteIn(outcome="failed", failure=Failure(kind="oom", message="CUDA out of memory"))
    with pytest.raises(ApiRejected) as err:
        client.complete("L-1", report)
    assert err.value.status == 422 and "field required" in err.value.detail


def test_redirect_is_refused_so_the_token_goes_nowhere_else():
    seen = []

    def handler(request):
        seen.append(request.url.host)
        return httpx.Response(307, headers={"location": "http://elsewhere.test/v1/x"})

    client, _ = make(handler)
    with pytest.raises(ApiRejected, match="set api_url"):
        client.lease(inventory())
    assert seen == ["api.test"]


def test_unreadable_answer_is_a_protocol_error():
    client, _ = make(lambda r: httpx.Response(200, json={"unexpected": True}))
    with pytest.raises(ApiProtocolError, match="upgrade spectune"):
        client.heartbeat("L-1")


def test_complete_and_progress_bodies():
    seen = []

    def handler(request):
        seen.append((request.url.raw_path.decode(), json.loads(request.content)))
        if request.url.path.endswith("/progress"):
            return httpx.Response(200, json={"action": "prune"})
        return httpx.Response(200, json={"lease_id": "L/2", "state": "complete", "speedup": 1.2})

    client, _ = make(handler)
    assert client.progress("L/2", ProgressIn(step=1, concurrency=8, output_tok_s=900.5)).action == "prune"
    report = CompleteIn(outcome="failed", failure=Failure(kind="lost", message="worker shutting down"))
    assert client.complete("L/2", report).speedup == 1.2
    assert seen[0] == (
        "/v1/leases/L%2F2/progress",
        {"step": 1, "concurrency": 8, "output_tok_s": 900.5, "accept_length": None, "phase": None},
    )
    assert seen[1][0] == "/v1/leases/L%2F2/complete" and seen[1][1]["failure"]["kind"] == "lost"


def test_token_never_logged(caplog):
    def handler(request):
        raise httpx.ConnectError("refused", request=request)

    client, _ = make(handler, retry_for_s=3)
    with caplog.at_level(logging.DEBUG), pytest.raises(ApiUnavailable):
        client.lease(inventory())
    assert "retry" in caplog.text and TOKEN not in caplog.text


def test_backoff_never_exceeds_its_cap():
    b = Backoff(initial_s=0.5, factor=3, max_s=10, jitter=0.5, rng=random.Random(1))
    delays = [b.delay(n) for n in range(200)]
    assert all(0 < d <= 10 for d in delays)
    assert delays[0] <= 0.5 and max(delays[50:]) > 5
