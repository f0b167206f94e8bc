"""The requests of one pass, run by a fixed set of worker tasks on one event loop.

Each worker claims the next request index from ``claim`` until the pass's ``count`` is used up,
so there is no task per request and no semaphore queue: the generator adds little scheduling
work per request.  In one process ``claim`` is a plain counter; when a level is sharded over
several generator processes (shards.py) it is a counter in shared memory, so the indices are
handed out in the same order either way and request ``i`` always uses ``prompts[i % len]``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from time import perf_counter

import httpx

from workers.loadgen.errors import LoadgenCancelled, LoadgenError
from workers.loadgen.request import RequestResult, stream_generate

# How often a running pass looks at the cancel event: bounds how late a cancel is noticed.
CANCEL_POLL_S = 0.05

Claim = Callable[[], int]
"""Returns the next request index of the pass (indices >= the pass's count mean: no more)."""


async def run_workers(
    *,
    client: httpx.AsyncClient,
    url: str,
    prompts: Sequence[str],
    count: int,
    workers: int,
    output_len: int,
    timeout_s: float,
    phase: str,
    claim: Claim,
    cancel: threading.Event | None,
    output_lens: Sequence[int] | None = None,
    arrivals: Sequence[float] | None = None,
) -> list[tuple[int, RequestResult]]:
    """Run ``workers`` concurrent streams until ``claim`` runs past ``count``.

    ``output_lens[j]``, when given, is prompt j's output length (else ``output_len`` for all).
    ``arrivals[i]``, when given (open loop), is when request i arrives, in seconds after this
    call: it is sent then, or as soon as one of the ``workers`` streams is free (the level's cap
    on requests in flight, as bench_serving's --max-concurrency).

    Returns (request index, result) for every request these workers ran, in completion order.
    Raises the first request's LoadgenError, or LoadgenCancelled once ``cancel`` is set.
    """
    done: list[tuple[int, RequestResult]] = []
    start = perf_counter()

    async def worker() -> None:
        for _ in range(count):  # each turn claims one of `count` indices: bounded
            i = claim()
            if i >= count:
                return
            j = i % len(prompts)
            if arrivals is not None:
                wait = start + arrivals[i] - perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)  # a cancel stops the task here too (run_tasks)
            result = await stream_generate(
                client,
                url,
                prompts[j],
                output_len=output_len if output_lens is None else output_lens[j],
                timeout_s=timeout_s,
                label=f"request {i + 1}/{count} ({phase}, prompt #{j})",
            )
            done.append((i, result))

    await run_tasks([worker() for _ in range(workers)], cancel, phase)
    return done


async def run_tasks(coros: list[Coroutine[object, object, None]], cancel: threading.Event | None, phase: str) -> None:
    """Run the workers; the first failure or a cancel stops them all and is raised."""
    pending: set[asyncio.Task[None]] = {asyncio.create_task(c) for c in coros}
    try:
        while pending:  # ends when every worker is done, one fails, or cancel is set
            done, pending = await asyncio.wait(
                pending,
                timeout=CANCEL_POLL_S if cancel is not None else None,
                return_when=asyncio.FIRST_EXCEPTION,
            )
            # Look at every finished task so no exception goes unretrieved; raise the first.
            errors = [e for t in done if (e := t.exception()) is not None]
            if errors:
                raise errors[0]
            raise_if_cancelled(cancel, phase)
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


def raise_if_cancelled(cancel: threading.Event | None, phase: str = "") -> None:
    if cancel is not None and cancel.is_set():
        raise LoadgenCancelled(f"load generator cancelled{' during ' + phase if phase else ''}")


def in_request_order(done: Sequence[tuple[int, RequestResult]], count: int, phase: str) -> list[RequestResult]:
    """The records of a pass by request index; every index in ``range(count)`` must be there."""
    records: list[RequestResult | None] = [None] * count
    for i, record in done:
        records[i] = record
    ordered = [r for r in records if r is not None]
    if len(ordered) != count:  # cannot happen unless a worker exits early: fail loudly, not silently
        raise LoadgenError(f"{phase}: only {len(ordered)} of {count} requests completed")
    return ordered
