"""Waiting for a starting server to be ready (docs/sglang.md §4).

Most of SGLang's start-up (weights, CUDA-graph capture) happens before the port opens, so the
wait first polls the TCP port, checking every time that the process is still alive.  Once the port
is open, `/ready` (200 only after the built-in warm-up; 404 on servers without it) is followed by
`/health_generate`, whose 200 is the gate; 503 from either means "still starting".
"""

from __future__ import annotations

import enum
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

logger = logging.getLogger("spectune.worker.launcher")

POLL_S = 0.25
_CONNECT_TIMEOUT_S = 1.0
_READY_TIMEOUT_S = 5.0
# /health_generate runs a one-token generation, itself bounded by SGLang at 20 s.
_HEALTH_TIMEOUT_S = 25.0


class Outcome(enum.Enum):
    READY = "ready"
    DIED = "died"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class ReadyResult:
    outcome: Outcome
    state: str  # the last thing seen, for messages: "port closed", "/health_generate 503", ...


def port_open(host: str, port: int, timeout_s: float = _CONNECT_TIMEOUT_S) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_until_ready(
    *,
    client: httpx.Client,
    base_url: str,
    host: str,
    port: int,
    is_alive: Callable[[], bool],
    deadline: float,
    cancel: threading.Event,
    clock: Callable[[], float] = time.monotonic,
    on_phase: Callable[[str], None] = lambda _phase: None,
    poll_s: float = POLL_S,
) -> ReadyResult:
    """Poll until ready, dead, cancelled or past `deadline` (a `clock()` value); never raises for those."""
    state = "port closed"
    port_seen = False
    use_ready = True  # turned off when the server has no /ready (404)
    on_phase("waiting_for_port")
    while True:
        if cancel.is_set():
            return ReadyResult(Outcome.CANCELLED, state)
        if not is_alive():
            return ReadyResult(Outcome.DIED, state)
        remaining = deadline - clock()
        if remaining <= 0:
            return ReadyResult(Outcome.TIMEOUT, state)
        if not port_seen:
            if port_open(host, port, min(_CONNECT_TIMEOUT_S, remaining)):
                port_seen = True
                state = "port open"
                logger.info("server port %d is open; waiting for /health_generate", port)
                on_phase("warming_up")
                continue
        else:
            try:
                if use_ready:
                    r = client.get(f"{base_url}/ready", timeout=min(_READY_TIMEOUT_S, remaining))
                    if r.status_code in (404, 405):
                        logger.info("server has no /ready endpoint; gating on /health_generate alone")
                        use_ready = False
                    else:
                        state = f"/ready {r.status_code}"
                if not use_ready or state == "/ready 200":
                    r = client.get(f"{base_url}/health_generate", timeout=min(_HEALTH_TIMEOUT_S, remaining))
                    state = f"/health_generate {r.status_code}"
                    if r.status_code == 200 and is_alive():
                        return ReadyResult(Outcome.READY, state)
            except httpx.HTTPError as e:
                # Refused or reset: a server going down, or one not listening yet; liveness decides.
                state = f"HTTP error {type(e).__name__}"
        cancel.wait(poll_s)
