"""The server's process group: who is in it, and stopping all of it (docs/sglang.md §10).

SGLang runs its scheduler(s) and detokenizer as children of the launch process, so a server is a
process group (the launcher starts it with `start_new_session=True`, pgid = pid of the leader).
Membership is read from /proc (zombies excluded: they hold nothing and are not ours to reap once
re-parented).  Descendants that moved to a group of their own are tracked by parent PID and
signalled one by one.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.errors import ProcessSurvivedError

logger = logging.getLogger("spectune.worker.launcher")

_PROC = Path("/proc")
_POLL_S = 0.1
# After SIGKILL the kernel needs only moments; a process still there after this is stuck.
KILL_WAIT_S = 10.0


@dataclass(frozen=True)
class _Stat:
    pid: int
    ppid: int
    pgid: int
    zombie: bool


def _read_stat(pid_dir: Path) -> _Stat | None:
    try:
        raw = (pid_dir / "stat").read_text()
    except OSError:  # gone meanwhile, or not ours to read
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ')'.
    head, _, rest = raw.rpartition(")")
    fields = rest.split()
    if not head or len(fields) < 3:
        return None
    return _Stat(pid=int(pid_dir.name), ppid=int(fields[1]), pgid=int(fields[2]), zombie=fields[0] in ("Z", "X"))


def _processes() -> list[_Stat]:
    out: list[_Stat] = []
    try:
        entries = list(_PROC.iterdir())
    except OSError:
        return out
    for d in entries:
        if d.name.isdigit():
            st = _read_stat(d)
            if st is not None:
                out.append(st)
    return out


def have_proc() -> bool:
    return (_PROC / "self" / "stat").exists()


def group_members(pgid: int) -> set[int]:
    """Live (non-zombie) processes of group `pgid`.  Without /proc: {pgid} while the group exists."""
    if not have_proc():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return set()
        except PermissionError:
            pass
        return {pgid}
    return {p.pid for p in _processes() if p.pgid == pgid and not p.zombie}


def descendants(roots: Iterable[int]) -> set[int]:
    """Live descendants of `roots` by parent PID (roots excluded)."""
    procs = [p for p in _processes() if not p.zombie]
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def alive(pids: Iterable[int]) -> set[int]:
    """Those of `pids` that are still running (zombies count as gone)."""
    live = set()
    for pid in pids:
        st = _read_stat(_PROC / str(pid)) if have_proc() else None
        if st is not None:
            if not st.zombie:
                live.add(pid)
        elif not have_proc():
            try:
                os.kill(pid, 0)
                live.add(pid)
            except ProcessLookupError:
                pass
            except PermissionError:
                live.add(pid)
    return live


def _signal_all(pgid: int, strays: Iterable[int], sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    for pid in strays:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_group(
    process: subprocess.Popen[Any],
    pgid: int,
    *,
    term_timeout_s: float,
    kill_wait_s: float = KILL_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
) -> set[int]:
    """SIGTERM the group, wait up to `term_timeout_s`, SIGKILL it, reap the leader.

    Returns every PID seen in the group or below the leader (the GPU-release wait needs them).
    Raises ProcessSurvivedError when something is still alive `kill_wait_s` after SIGKILL.
    """
    seen = {process.pid} | group_members(pgid) | descendants([process.pid])

    def remaining() -> set[int]:
        process.poll()  # reap the leader as soon as it exits
        members = group_members(pgid)
        seen.update(members)
        # The reaped leader's PID may be reused at once: it is judged by returncode alone.
        live = members | alive(seen - members - {process.pid})
        if process.returncode is None:
            live.add(process.pid)
        return live

    def wait_gone(wait_s: float) -> set[int]:
        deadline = clock() + wait_s
        while True:
            live = remaining()
            if not live or clock() >= deadline:
                return live
            time.sleep(_POLL_S)

    live = remaining()
    if not live:
        return seen
    logger.info("stopping server pgid %d: SIGTERM to pids %s", pgid, sorted(live))
    # Members die with the group; strays (a session of their own) need their own signal.
    _signal_all(pgid, live - group_members(pgid), signal.SIGTERM)
    live = wait_gone(term_timeout_s)
    if not live:
        return seen
    logger.warning(
        "server pgid %d still running %.0f s after SIGTERM: SIGKILL to pids %s", pgid, term_timeout_s, sorted(live)
    )
    _signal_all(pgid, live - group_members(pgid), signal.SIGKILL)
    live = wait_gone(kill_wait_s)
    if live:
        raise ProcessSurvivedError(pgid, sorted(live))
    return seen
