"""Two-stage SIGTERM/SIGINT handling for the worker process (workers/main.py installs it)."""

from __future__ import annotations

import logging
import select
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType
from typing import Any

log = logging.getLogger("spectune.worker.agent")


class ShutdownSignals:
    """Two-stage SIGTERM/SIGINT handling with no work inside the handlers.

    The Python handler only counts; `signal.set_wakeup_fd` makes the interpreter write the signal
    number to a socket, and a watcher thread wakes on it (or within a second, should something
    else have taken the wakeup fd) and calls `first(signum)` once, then `second(signum)` on any
    later signal.  Setting an Event inside a handler could deadlock on the Event's own lock if the
    main thread happened to hold it.  Install from the main thread only.
    """

    def __init__(
        self,
        first: Callable[[int], None],
        second: Callable[[int], None],
        signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
    ) -> None:
        self._first = first
        self._second = second
        self._signals = tuple(signals)
        self._received: list[int] = []
        self._handled = 0
        self._closing = False
        self._old_handlers: dict[signal.Signals, Any] = {}
        self._old_fd = -1
        self._rsock, self._wsock = socket.socketpair()
        self._thread = threading.Thread(target=self._watch, name="signal-watcher", daemon=True)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self._received.append(signum)  # list.append is atomic; the watcher does the rest

    def __enter__(self) -> ShutdownSignals:
        self._wsock.setblocking(False)
        self._rsock.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._wsock.fileno(), warn_on_full_buffer=False)
        for s in self._signals:
            self._old_handlers[s] = signal.signal(s, self._handler)
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        for s, old in self._old_handlers.items():
            signal.signal(s, old)
        signal.set_wakeup_fd(self._old_fd)
        self._closing = True
        try:
            self._wsock.send(b"\0")
        except OSError:
            pass
        self._thread.join(5.0)
        self._rsock.close()
        self._wsock.close()

    def _watch(self) -> None:
        while not self._closing:
            readable, _, _ = select.select([self._rsock], [], [], 1.0)
            if readable:
                try:
                    self._rsock.recv(512)
                except BlockingIOError:
                    pass
            while self._handled < len(self._received):
                signum = self._received[self._handled]
                self._handled += 1
                try:
                    (self._first if self._handled == 1 else self._second)(signum)
                except Exception:
                    log.exception("handling signal %d failed", signum)
