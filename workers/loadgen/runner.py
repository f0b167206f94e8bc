"""Run a workload's concurrency levels against an SGLang server (or the simulated engine).

Per level: ``warmup_requests`` untimed requests, then ``repeats`` timed passes of
``num_prompts`` requests, each pass keeping at most ``concurrency`` requests in flight.  Request
``i`` of every pass (and of the warm-up) uses ``prompts[i % len(prompts)]``, so a baseline and a
trial see the same prompts in the same order.

Concurrency is a fixed set of ``concurrency`` worker tasks that take the next request index
from a shared counter: no task per request and no semaphore queue, so the generator itself adds
little scheduling work per request.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from time import perf_counter

import httpx

from api.protocol import LevelMetrics
from optimizer.spec import Workload
from workers.loadgen.errors import LoadgenCancelled, LoadgenError
from workers.loadgen.http1 import LoadgenClient
from workers.loadgen.request import RequestResult, stream_generate
from workers.loadgen.stats import PassResult, summarize_level

# How often a running pass looks at the cancel event: bounds how late a cancel is noticed.
CANCEL_POLL_S = 0.05
# Connecting to a local server should be quick; a hung connect should not wait the whole
# request time-out.
CONNECT_TIMEOUT_S = 30.0


async def run_level(
    client: httpx.AsyncClient,
    base_url: str,
    prompts: Sequence[str],
    *,
    concurrency: int,
    num_prompts: int,
    output_len: int,
    warmup_requests: int,
    repeats: int,
    request_timeout_s: float = 600.0,
    cancel: threading.Event | None = None,
) -> LevelMetrics:
    """Measure one concurrency level.

    Use ``make_client()`` for ``client``.  Any other client must allow at least ``concurrency``
    simultaneous connections (httpx's default pool allows 100), otherwise requests queue inside
    the client; and plain httpx streaming costs about 10x more CPU per event than the fast path
    that ``make_client()`` clients carry.

    Raises:
        ValueError: an argument is out of range or there are no prompts.
        LoadgenError: a request failed (the message names it and says why).
        LoadgenCancelled: ``cancel`` was set; requests in flight are abandoned.
    """
    _check_args(prompts, concurrency, num_prompts, output_len, warmup_requests, repeats, request_timeout_s)
    url = base_url.rstrip("/") + "/generate"

    async def one_pass(count: int, phase: str) -> PassResult:
        return await _run_pass(
            client=client,
            url=url,
            prompts=prompts,
            count=count,
            concurrency=concurrency,
            output_len=output_len,
            timeout_s=request_timeout_s,
            cancel=cancel,
            phase=phase,
        )

    if warmup_requests:
        await one_pass(warmup_requests, f"c={concurrency} warm-up")
    passes = [await one_pass(num_prompts, f"c={concurrency} pass {r + 1}/{repeats}") for r in range(repeats)]
    return summarize_level(concurrency, passes)


def run_workload(
    base_url: str,
    workload: Workload,
    prompts: Sequence[str],
    *,
    cancel: threading.Event | None = None,
    on_level: Callable[[int, LevelMetrics], bool] | None = None,
    request_timeout_s: float = 600.0,
) -> list[LevelMetrics]:
    """Measure every concurrency level of ``workload`` in order; blocking (runs its own event loop).

    ``on_level(index, metrics)`` is called after each level (from the loop's thread, with no
    request in flight); returning False stops before the next level (the API said prune).
    Setting ``cancel`` from another thread raises LoadgenCancelled within about 50 ms.
    """
    return asyncio.run(
        _run_workload(base_url, workload, prompts, cancel=cancel, on_level=on_level, timeout_s=request_timeout_s)
    )


async def _run_workload(
    base_url: str,
    workload: Workload,
    prompts: Sequence[str],
    *,
    cancel: threading.Event | None,
    on_level: Callable[[int, LevelMetrics], bool] | None,
    timeout_s: float,
) -> list[LevelMetrics]:
    results: list[LevelMetrics] = []
    async with make_client(timeout_s) as client:
        for index, concurrency in enumerate(workload.concurrency):
            _raise_if_cancelled(cancel)
            metrics = await run_level(
                client,
                base_url,
                prompts,
                concurrency=concurrency,
                num_prompts=workload.num_prompts,
                output_len=workload.output_len,
                warmup_requests=workload.warmup_requests,
                repeats=workload.repeats,
                request_timeout_s=timeout_s,
                cancel=cancel,
            )
            results.append(metrics)
            if on_level is not None and not on_level(index, metrics):
                break
    return results


def make_client(request_timeout_s: float = 600.0) -> httpx.AsyncClient:
    """The client ``run_workload`` uses: an httpx client carrying the fast SSE path (http1.py).

    The fast path keeps the generator far from being the bottleneck (http1.py says why).
    ``trust_env=False``: the engine is on this host, so an HTTP(S)_PROXY meant for the API must
    not route benchmark traffic through a proxy.
    """
    connect_s = min(CONNECT_TIMEOUT_S, request_timeout_s)
    timeout = httpx.Timeout(request_timeout_s, connect=connect_s)
    return LoadgenClient(connect_timeout_s=connect_s, timeout=timeout, trust_env=False)


async def _run_pass(
    *,
    client: httpx.AsyncClient,
    url: str,
    prompts: Sequence[str],
    count: int,
    concurrency: int,
    output_len: int,
    timeout_s: float,
    cancel: threading.Event | None,
    phase: str,
) -> PassResult:
    _raise_if_cancelled(cancel)
    results: list[RequestResult | None] = [None] * count
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < count:  # each turn claims one of `count` indices: bounded
            i = next_index
            next_index += 1
            j = i % len(prompts)
            results[i] = await stream_generate(
                client,
                url,
                prompts[j],
                output_len=output_len,
                timeout_s=timeout_s,
                label=f"request {i + 1}/{count} ({phase}, prompt #{j})",
            )

    started = perf_counter()
    await _run_tasks([worker() for _ in range(min(concurrency, count))], cancel, phase)
    wall_s = perf_counter() - started
    done = [r for r in results if r is not None]
    if len(done) != count:  # cannot happen unless a worker exits early: fail loudly, not silently
        raise LoadgenError(f"{phase}: only {len(done)} of {count} requests completed")
    return PassResult(wall_s=wall_s, requests=done)


async def _run_tasks(coros: list[Coroutine[object, object, None]], cancel: threading.Event | None, phase: str) -> None:
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
            _raise_if_cancelled(cancel, phase)
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


def _raise_if_cancelled(cancel: threading.Event | None, phase: str = "") -> None:
    if cancel is not None and cancel.is_set():
        raise LoadgenCancelled(f"load generator cancelled{' during ' + phase if phase else ''}")


def _check_args(
    prompts: Sequence[str],
    concurrency: int,
    num_prompts: int,
    output_len: int,
    warmup_requests: int,
    repeats: int,
    request_timeout_s: float,
) -> None:
    if not prompts:
        raise ValueError("no prompts to send")
    for name, value, low in (
        ("concurrency", concurrency, 1),
        ("num_prompts", num_prompts, 1),
        ("output_len", output_len, 1),
        ("warmup_requests", warmup_requests, 0),
        ("repeats", repeats, 1),
    ):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be positive, got {request_timeout_s}")
