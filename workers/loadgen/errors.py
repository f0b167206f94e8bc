"""Errors the load generator raises.

LoadgenError
 └── LoadgenCancelled

A LoadgenError means the measurement is invalid (a request failed, the server sent an error event,
a request produced the wrong number of tokens, a time-out); its message names the request and the
reason, so the worker can report it as a ``benchmark_error`` as is.
"""

from __future__ import annotations


class LoadgenError(Exception):
    """A request failed or the measurement cannot be trusted."""


class LoadgenCancelled(LoadgenError):
    """The caller set the cancel event; requests in flight were abandoned."""
