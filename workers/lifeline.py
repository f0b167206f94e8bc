"""Die with the parent: a child told so by its parent stops itself when that parent is gone.

Every process spectune starts lives in a process group of its own (so its own children can be
stopped as one), which also means a parent killed with SIGKILL, or a test that timed out, takes
nothing down with it.  A parent that wants its children to follow it sets
`SPECTUNE_EXIT_WITH_PARENT=<its pid>` in their environment; `exit_with_parent()` then watches
from a daemon thread and, once the process was re-parented, sends itself SIGTERM (the graceful
path: the worker stops its engine and reports the lease lost; the API and the simulator drain),
then a second SIGTERM if that did not end it (the worker's forced path kills its engine's group).

On GPU hosts systemd does the same for the worker's cgroup; this covers the demo, tests and
benchmarks, and engines of a worker that was SIGKILLed.  Linux's PR_SET_PDEATHSIG would need a
pre-exec hook, which is unsafe in a process with threads, and fires when the forking *thread*
exits, so it is not used.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping, MutableMapping

log = logging.getLogger("spectune.lifeline")

ENV = "SPECTUNE_EXIT_WITH_PARENT"
# An opaque id passed down to every process of one run (demo, test, benchmark), engines included,
# so all of them can be found: `grep -l SPECTUNE_RUN_ID=<id> /proc/*/environ`.
RUN_ID_ENV = "SPECTUNE_RUN_ID"
POLL_S = 0.5
# Between the graceful SIGTERM and the forced one: a worker stops its engine and reports first.
GRACE_S = 30.0


def child_env(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: a copy of os.environ) with this process as the parent to exit with."""
    out = dict(os.environ if env is None else env)
    out[ENV] = str(os.getpid())
    return out


def exit_with_parent(environ: Mapping[str, str] | None = None) -> threading.Thread | None:
    """Start the watch if the environment asks for it; returns the thread (None: not asked)."""
    raw = (os.environ if environ is None else environ).get(ENV, "")
    if not raw.isdigit():
        return None
    parent = int(raw)
    if os.getppid() != parent:  # already orphaned before we got here
        _stop(parent)
        return None
    thread = threading.Thread(target=_watch, args=(parent,), name="lifeline", daemon=True)
    thread.start()
    return thread


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    _stop(parent)


def _stop(parent: int) -> None:
    log.warning("parent process %d is gone: stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGTERM)
