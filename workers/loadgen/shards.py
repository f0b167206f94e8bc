"""Spread a level's concurrent streams over several load-generator processes.

One event loop consumes ~40-50k one-token SSE events/s (benchmarks/README.md, "Load generator
capacity"); an engine at high concurrency emits ~8k/s, too close to a 10x margin.  A
``ShardPool`` runs a pass's streams in ``processes`` spawned processes (shard_process.py), each
on its own core and event loop, and merges what they measured exactly as one process would:

- the pass's ``min(concurrency, count)`` streams are split evenly over the shards, so at most
  ``concurrency`` requests are in flight in total;
- request indices come from one shared counter, so request ``i`` uses ``prompts[i % len]`` and
  the indices are handed out in order, as in one process;
- every shard of a pass starts at the same instant (a start time on the host-wide monotonic
  clock), and the next pass starts only after every shard finished the previous one;
- the pass's wall time is (last shard's end - first shard's start), so output tok/s is
  Σ tokens / that; the records are merged in request order, so percentiles, per-user rates and
  accept length are computed over all requests as before (stats.summarize_level).

A failed request in any shard stops the others and is raised as that request's LoadgenError; the
caller's cancel event stops every shard within ~100 ms; a shard that dies is a LoadgenError
naming it.  Every wait has a deadline.

Processes are started with the ``spawn`` context (no fork of a threaded parent), so, as with any
multiprocessing program, the main module must be importable without side effects.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.sharedctypes import Synchronized
from types import TracebackType

from workers.loadgen.errors import LoadgenCancelled, LoadgenError
from workers.loadgen.passes import CANCEL_POLL_S, in_request_order
from workers.loadgen.shard_process import Message, PassOrder, ShardReply, clock, shard_main
from workers.loadgen.stats import PassResult

# Spawning interpreters that import httpx/numpy takes ~0.5 s of CPU each; on a loaded host, more.
START_TIMEOUT_S = 120.0
# Time between sending a pass's orders and its start: enough for every shard to receive its order.
START_LEAD_S = 0.02
# How long shards get to answer a cancel or exit before they are terminated.
STOP_TIMEOUT_S = 10.0
# A pass whose shards are silent this long past their worst case (count x request time-out) is stuck.
PASS_SLACK_S = 60.0


@dataclass(frozen=True, slots=True)
class ShardedPass:
    """A pass run by several shards: the merged result and each shard's CPU seconds during it."""

    result: PassResult
    cpu_s: tuple[float, ...]


@dataclass(slots=True)
class _Shard:
    index: int
    process: BaseProcess
    conn: Connection


class ShardPool:
    """Up to ``processes`` generator processes against one server; use as ``async with``.

    The processes start on the first pass (or ``start()``) and stay up for later passes and
    levels until the pool is closed.  One pass at a time.
    """

    def __init__(
        self,
        processes: int,
        *,
        base_url: str,
        prompts: Sequence[str],
        request_timeout_s: float,
        start_timeout_s: float = START_TIMEOUT_S,
        output_lens: Sequence[int] | None = None,
    ) -> None:
        if processes < 2:
            raise ValueError(f"a shard pool needs at least 2 processes, got {processes}; use one event loop instead")
        if not prompts:
            raise ValueError("no prompts to send")
        self.size = processes
        self._base_url = base_url
        self._prompts = list(prompts)
        # Per-prompt output lengths (a dataset's or drawn ones); None: the pass's output_len.
        self._output_lens = None if output_lens is None else list(output_lens)
        self._request_timeout_s = request_timeout_s
        self._start_timeout_s = start_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._counter: Synchronized[int] | None = None
        self._shards: list[_Shard] = []
        self._broken: str | None = None  # why the pool cannot run another pass

    async def __aenter__(self) -> ShardPool:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    @property
    def pids(self) -> list[int]:
        """Process ids of the running shards (empty before the first pass)."""
        return [s.process.pid for s in self._shards if s.process.pid is not None]

    async def start(self, cancel: threading.Event | None = None) -> None:
        """Start the processes and wait until each has its client ready."""
        if self._shards:
            return
        if self._broken:
            raise LoadgenError(self._broken)
        counter: Synchronized[int] = self._ctx.Value("q", 0)
        self._counter = counter
        for k in range(self.size):
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            process = self._ctx.Process(
                target=shard_main,
                args=(child_conn, counter, self._base_url, self._prompts, self._request_timeout_s, self._output_lens),
                name=f"spectune-loadgen-{k}",
                daemon=True,  # never outlive the parent's interpreter
            )
            self._shards.append(_Shard(k, process, parent_conn))
            process.start()
            child_conn.close()  # only the child holds its end now: its death reads as EOF here
        try:
            replies = await self._collect(self._shards, self._start_timeout_s, cancel, "load generator start-up")
        except LoadgenError as e:
            self._break(f"the load generator's processes did not start: {e}")
            raise
        for k, msg in replies.items():
            if msg[0] != "ready":
                self._break(f"load generator process {k} answered {msg[0]!r} instead of 'ready'")
                raise LoadgenError(self._broken or "")

    async def run_pass(
        self,
        *,
        count: int,
        concurrency: int,
        output_len: int,
        phase: str,
        cancel: threading.Event | None = None,
        processes: int | None = None,
    ) -> ShardedPass:
        """Run ``count`` requests with ``min(concurrency, count)`` streams over ``processes`` shards.

        ``processes`` defaults to the pool's size and may not exceed it.
        """
        use = self.size if processes is None else processes
        if not 1 <= use <= self.size:
            raise ValueError(f"processes must be between 1 and the pool's size {self.size}, got {use}")
        if self._broken:
            raise LoadgenError(self._broken)
        await self.start(cancel)
        assert self._counter is not None
        streams = min(concurrency, count)
        shares = [streams // use + (k < streams % use) for k in range(use)]
        busy = [s for s, n in zip(self._shards, shares, strict=False) if n > 0]
        self._counter.value = 0  # every shard is idle between passes
        start_at = clock() + START_LEAD_S
        for shard, n in zip(busy, shares, strict=False):
            self._send(shard, ("pass", PassOrder(count, n, output_len, phase, start_at)))
        timeout_s = START_LEAD_S + count * self._request_timeout_s + PASS_SLACK_S
        replies = await self._collect(busy, timeout_s, cancel, phase)
        return _merge(replies, count, phase)

    async def aclose(self) -> None:
        """Ask every process to exit; terminate, then kill, those that do not within the deadline."""
        shards, self._shards = self._shards, []
        self._broken = self._broken or "the load generator's process pool is closed"
        for shard in shards:
            self._send(shard, ("exit",))
        await _wait_exit(shards, STOP_TIMEOUT_S)
        for shard in shards:
            if shard.process.is_alive():
                shard.process.terminate()
        await _wait_exit(shards, STOP_TIMEOUT_S)
        for shard in shards:
            if shard.process.is_alive():
                shard.process.kill()
        await _wait_exit(shards, STOP_TIMEOUT_S)
        for shard in shards:
            shard.conn.close()
            shard.process.join(0)

    # -- internals ------------------------------------------------------------------------------

    def _send(self, shard: _Shard, msg: Message) -> None:
        try:
            shard.conn.send(msg)
        except OSError:
            pass  # the process is gone; _collect reports it

    def _break(self, why: str) -> None:
        self._broken = self._broken or why

    async def _collect(
        self, shards: Sequence[_Shard], timeout_s: float, cancel: threading.Event | None, phase: str
    ) -> dict[int, Message]:
        """One reply from each of ``shards``; raises the first failure once all have answered.

        On the first failure (a shard's error, a dead shard, the caller's cancel) the others are
        told to cancel, and their answers are awaited for up to STOP_TIMEOUT_S, so that on return
        or raise no shard is busy; a shard that does not answer breaks the pool.
        """
        loop = asyncio.get_running_loop()
        waiting = {s.index: s for s in shards}
        replies: dict[int, Message] = {}
        failure: LoadgenError | None = None
        deadline = loop.time() + timeout_s

        def fail(error: LoadgenError) -> None:
            nonlocal failure, deadline
            if failure is None:
                failure = error
                for other in waiting.values():
                    self._send(other, ("cancel",))
                deadline = min(deadline, loop.time() + STOP_TIMEOUT_S)

        while waiting:  # bounded by the deadline
            if failure is None and cancel is not None and cancel.is_set():
                fail(LoadgenCancelled(f"load generator cancelled during {phase}"))
            remaining = deadline - loop.time()
            if remaining <= 0:
                ids = ", ".join(f"{k} (pid {waiting[k].process.pid})" for k in sorted(waiting))
                self._break(f"{phase}: load generator process(es) {ids} did not answer within {timeout_s:g} s")
                await self.aclose()
                raise failure or LoadgenError(self._broken or "")
            await _wait_readable(list(waiting.values()), min(remaining, CANCEL_POLL_S))
            for shard in list(waiting.values()):
                msg = _poll(shard)
                if msg is None:
                    continue
                del waiting[shard.index]
                if msg[0] == "gone":
                    why = (
                        f"{phase}: load generator process {shard.index} (pid {shard.process.pid}) exited "
                        f"unexpectedly (exit code {shard.process.exitcode}); was it killed?"
                    )
                    self._break(why)
                    fail(LoadgenError(why))
                elif msg[0] == "error":
                    text, cancelled = str(msg[1]), bool(msg[2])
                    fail(LoadgenCancelled(text) if cancelled else LoadgenError(text))
                else:
                    replies[shard.index] = msg
        if failure is not None:
            raise failure
        return replies


def _poll(shard: _Shard) -> Message | None:
    """The shard's reply if one is there; ("gone",) if its pipe closed or it exited; else None."""
    try:
        if shard.conn.poll():
            msg: Message = shard.conn.recv()
            return msg
    except (EOFError, OSError):
        return ("gone",)
    if not shard.process.is_alive():
        return ("gone",)
    return None


async def _wait_readable(shards: Sequence[_Shard], timeout_s: float) -> None:
    """Return when a shard's pipe or process sentinel is readable, or after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    woke: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not woke.done():
            woke.set_result(None)

    fds = [s.conn.fileno() for s in shards] + [s.process.sentinel for s in shards]
    for fd in fds:
        loop.add_reader(fd, wake)
    try:
        await asyncio.wait([woke], timeout=timeout_s)
    finally:
        for fd in fds:
            loop.remove_reader(fd)
        woke.cancel()


async def _wait_exit(shards: Sequence[_Shard], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(s.process.is_alive() for s in shards) and time.monotonic() < deadline:  # bounded
        await asyncio.sleep(0.01)


def _merge(replies: dict[int, Message], count: int, phase: str) -> ShardedPass:
    parts = [msg[1] for msg in replies.values()]
    assert all(isinstance(p, ShardReply) for p in parts)
    shard_replies = [p for p in parts if isinstance(p, ShardReply)]
    done = in_request_order([r for part in shard_replies for r in part.results], count, phase)
    wall_s = max(p.ended for p in shard_replies) - min(p.started for p in shard_replies)
    return ShardedPass(PassResult(wall_s=wall_s, requests=done), tuple(p.cpu_s for p in shard_replies))


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under taskset or a cgroup cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
