"""What runs inside one load-generator process of a sharded level (the parent side: shards.py).

A shard is a spawned Python process with its own event loop and fast-path client.  It waits for
orders on its pipe and answers each with exactly one reply:

    parent -> shard   ("pass", PassOrder)     run `workers` streams of a pass
                      ("cancel",)             abandon the pass in flight (no-op when idle)
                      ("exit",)               abandon any pass and exit
    shard -> parent   ("ready", pid)          once, after start-up
                      ("done", ShardReply)    the pass finished; its requests' records
                      ("error", text, cancelled)   the pass failed (text names the request)

Request indices come from a counter in shared memory, so the shards of a pass hand them out in
the same order one process would.  Pass boundaries use CLOCK_MONOTONIC, which every process on
the host shares, so the parent can merge them into one pass wall time.

A shard ignores SIGINT (a Ctrl-C at a terminal is the parent's to handle) and exits when its pipe
closes, so it never outlives a parent that died without cleaning up.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized

from workers.loadgen.errors import LoadgenCancelled, LoadgenError
from workers.loadgen.http1 import make_client
from workers.loadgen.passes import run_workers
from workers.loadgen.request import RequestResult


def clock() -> float:
    """Seconds on the host-wide monotonic clock: comparable between processes."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


@dataclass(frozen=True, slots=True)
class PassOrder:
    """One shard's part of a pass: ``workers`` of the pass's streams, from ``start_at`` on."""

    count: int
    workers: int
    output_len: int
    phase: str
    start_at: float  # clock() value; shards of a pass all start then (or at once if late)


@dataclass(frozen=True, slots=True)
class ShardReply:
    """What a shard measured in a pass."""

    started: float  # clock() when its streams started
    ended: float  # clock() when its last stream finished
    cpu_s: float  # this process's CPU seconds during the pass (reply serialisation excluded)
    results: list[tuple[int, RequestResult]]  # (request index, record) of the requests it ran


Message = tuple[object, ...]


def shard_main(
    conn: Connection,
    counter: Synchronized[int],
    base_url: str,
    prompts: Sequence[str],
    request_timeout_s: float,
    output_lens: Sequence[int] | None = None,
) -> None:
    """Entry point of a shard process (multiprocessing target; spawn context)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        url = base_url.rstrip("/") + "/generate"
        asyncio.run(_serve(conn, counter, url, prompts, request_timeout_s, output_lens))
    finally:
        conn.close()


class _Inbox:
    """Reads orders as they arrive; a cancel or exit order, or the pipe closing, sets ``stop``."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        self.stop = threading.Event()  # polled by run_workers, like the caller's cancel event
        self.gone = False  # the parent closed the pipe (or died): nothing more will come

    def on_readable(self) -> None:
        try:
            while self.conn.poll():  # bounded by what the parent has written
                msg: Message = self.conn.recv()
                if msg[0] in ("cancel", "exit"):
                    self.stop.set()
                self.queue.put_nowait(msg)
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            self.gone = True
            self.stop.set()
            self.queue.put_nowait(("exit",))


async def _serve(
    conn: Connection,
    counter: Synchronized[int],
    url: str,
    prompts: Sequence[str],
    timeout_s: float,
    output_lens: Sequence[int] | None = None,
) -> None:
    inbox = _Inbox(conn)
    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), inbox.on_readable)

    def claim() -> int:
        with counter.get_lock():
            i = int(counter.value)
            counter.value = i + 1
        return i

    async with make_client(timeout_s) as client:
        conn.send(("ready", os.getpid()))
        while True:  # one order per turn; ends on an exit order or when the pipe closes
            msg = await inbox.queue.get()
            if msg[0] == "exit":
                return
            if msg[0] != "pass":
                continue  # a cancel that arrived after its pass had finished
            if inbox.gone:
                return
            inbox.stop.clear()
            order = msg[1]
            assert isinstance(order, PassOrder)
            delay = order.start_at - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            cpu0 = time.process_time()
            started = clock()
            reply: Message
            try:
                results = await run_workers(
                    client=client,
                    url=url,
                    prompts=prompts,
                    output_lens=output_lens,
                    count=order.count,
                    workers=order.workers,
                    output_len=order.output_len,
                    timeout_s=timeout_s,
                    phase=order.phase,
                    claim=claim,
                    cancel=inbox.stop,
                )
            except LoadgenError as e:
                reply = ("error", str(e), isinstance(e, LoadgenCancelled))
            except Exception as e:  # a bug here must reach the parent as text, not a dead pipe
                reply = ("error", f"{order.phase}: load generator process failed: {type(e).__name__}: {e}", False)
            else:
                reply = ("done", ShardReply(started, clock(), time.process_time() - cpu0, results))
            try:
                conn.send(reply)
            except OSError:  # the parent is gone
                return
