"""Follow the parent: a simulated engine whose worker was SIGKILLed stops itself.

The protocol is the worker's (real SGLang relies on systemd's cgroup instead): a parent that wants
its children to follow it sets `SPECTUNE_EXIT_WITH_PARENT=<its pid>`; once this process has been
re-parented it sends itself SIGTERM (the server drains), then again after a grace period.
Written here again rather than imported from `workers/`, which the simulator must not depend on.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping

ENV = "SPECTUNE_EXIT_WITH_PARENT"
POLL_S = 0.5
GRACE_S = 30.0

log = logging.getLogger("spectune_sim.lifeline")


def follow_parent(environ: Mapping[str, str]) -> threading.Thread | None:
    """Watch the parent named in `environ` from a daemon thread; None when none is named."""
    raw = environ.get(ENV, "")
    if not raw.isdigit():
        return None
    parent = int(raw)
    thread = threading.Thread(target=_watch, args=(parent,), name="lifeline", daemon=True)
    thread.start()
    return thread


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    log.warning("parent process %d is gone: stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGTERM)
