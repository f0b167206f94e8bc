"""Errors the load generator raises.

LoadgenError
 ├── LoadgenCancelled
 └── EngineRejected

A LoadgenError means the measurement is invalid (a request failed, the server sent an error event,
a request produced the wrong number of tokens, a time-out); its message names the request and the
reason, so the worker can report it as a ``benchmark_error`` as is.
"""

from __future__ import annotations


class LoadgenError(Exception):
    """A request failed or the measurement cannot be trusted."""


class LoadgenCancelled(LoadgenError):
    """The caller set the cancel event; requests in flight were abandoned."""


class EngineRejected(LoadgenError):
    """The engine answered a benchmark request with HTTP 4xx: it refuses what the study's workload
    asks (a prompt longer than its context, sampling parameters it rejects), not a sick host."""

    def __init__(self, message: str, status: int, body: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
