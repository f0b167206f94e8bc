"""Run a workload's concurrency levels against an SGLang server (or the simulated engine).

Per level: ``warmup_requests`` untimed requests, then ``repeats`` timed passes of
``num_prompts`` requests, each pass keeping at most ``concurrency`` requests in flight.  Request
``i`` of every pass (and of the warm-up) uses ``prompts[i % len(prompts)]``, so a baseline and a
trial see the same prompts in the same order.

A pass runs on this process's event loop (passes.py), or, at high concurrency on a host with
cores to spare, spread over several generator processes (shards.py) that together measure
exactly what one loop would, so the generator stays >= 10x faster than what it measures.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter

import httpx

from optimizer.spec import Workload
from spectune_protocol import LevelMetrics, Slo
from workers.loadgen.http1 import CONNECT_TIMEOUT_S, make_client
from workers.loadgen.passes import CANCEL_POLL_S, in_request_order, raise_if_cancelled, run_workers
from workers.loadgen.plan import arrival_offsets
from workers.loadgen.saturation import LevelWatch, engine_probe
from workers.loadgen.shards import ShardPool, available_cpus
from workers.loadgen.stats import PassResult, summarize_level

__all__ = [
    "CANCEL_POLL_S",
    "CONNECT_TIMEOUT_S",
    "MAX_PROCESSES",
    "STREAMS_PER_PROCESS",
    "default_processes",
    "make_client",
    "run_level",
    "run_workload",
]

# One event loop consumes >= 40k one-token events/s; an engine's busiest setting emits ~8k/s at
# concurrency 64, i.e. ~130 events/s per stream.  16 streams per process keeps each loop near
# 2k events/s, >= 20x below its capacity, with headroom for engines twice as fast.
STREAMS_PER_PROCESS = 16
# Beyond this, more processes add start-up time and contention but no useful margin.
MAX_PROCESSES = 8

log = logging.getLogger("spectune.loadgen")

PassRunner = Callable[[int, str], Awaitable[PassResult]]
"""Runs one pass of ``count`` requests labelled ``phase``."""


def default_processes(concurrency: int, cpus: int) -> int:
    """How many generator processes a level of ``concurrency`` streams gets on ``cpus`` CPUs.

    One per STREAMS_PER_PROCESS streams, at most MAX_PROCESSES, and at most half the CPUs: the
    engine's own scheduler, tokenizer and detokenizer processes need cores on the same host.
    So a 2-core machine never shards, and a 16-core GPU host runs concurrency 64 on 4 processes.
    """
    return max(1, min(math.ceil(concurrency / STREAMS_PER_PROCESS), MAX_PROCESSES, cpus // 2))


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
    processes: int = 1,
    engine_pids: Callable[[], Sequence[int]] | None = None,
) -> LevelMetrics:
    """Measure one concurrency level.

    Use ``make_client()`` for ``client``.  Any other client must allow at least ``concurrency``
    simultaneous connections (httpx's default pool allows 100), otherwise requests queue inside
    the client; and plain httpx streaming costs about 10x more CPU per event than the fast path
    that ``make_client()`` clients carry.

    ``processes`` > 1 spreads the streams over that many generator processes (at most one per
    stream), started for this call; they use their own fast-path clients, not ``client``.
    ``run_workload`` does this by itself when it helps (``default_processes``).

    ``engine_pids`` names the engine's processes for the host check (saturation.py); a level
    the load checks fail is measured once more and then carries ``saturated``.

    Raises:
        ValueError: an argument is out of range or there are no prompts.
        LoadgenError: a request failed (the message names it and says why).
        LoadgenCancelled: ``cancel`` was set; requests in flight are abandoned.
    """
    _check_args(prompts, concurrency, num_prompts, output_len, warmup_requests, repeats, request_timeout_s)
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    processes = min(processes, concurrency)
    args = (concurrency, num_prompts, warmup_requests, repeats)
    if processes > 1:
        async with ShardPool(
            processes, base_url=base_url, prompts=prompts, request_timeout_s=request_timeout_s
        ) as pool:
            run = _sharded_runner(pool, processes, concurrency, output_len, cancel)
            return await _measure_level(run, *args, watch=_watch(client, base_url, concurrency, pool, engine_pids))
    local = _local_runner(client, base_url, prompts, concurrency, output_len, request_timeout_s, cancel)
    return await _measure_level(local, *args, watch=_watch(client, base_url, concurrency, None, engine_pids))


def _watch(
    client: httpx.AsyncClient,
    base_url: str,
    concurrency: int,
    pool: ShardPool | None,
    engine_pids: Callable[[], Sequence[int]] | None = None,
    open_loop: bool = False,
) -> Callable[[], LevelWatch]:
    """The load checks of one level: this process, the pool's shards, the engine's /metrics and processes."""
    probe = engine_probe(client, base_url)
    return lambda: LevelWatch(
        concurrency,
        pids=lambda: [] if pool is None else pool.pids,
        engine=probe,
        engine_pids=engine_pids,
        open_loop=open_loop,
    )


def run_workload(
    base_url: str,
    workload: Workload,
    prompts: Sequence[str],
    *,
    cancel: threading.Event | None = None,
    on_level: Callable[[int, LevelMetrics], bool] | None = None,
    request_timeout_s: float = 600.0,
    processes: int | None = None,
    engine_pids: Callable[[], Sequence[int]] | None = None,
    output_lens: Sequence[int] | None = None,
    slo: Slo | None = None,
) -> list[LevelMetrics]:
    """Measure every concurrency level of ``workload`` in order; blocking (runs its own event loop).

    ``output_lens[j]``: prompt j's output length (workers/loadgen/plan.py), else the workload's
    ``output_len`` for every request.  With ``workload.request_rate`` (open loop) requests arrive
    on a Poisson schedule and each level caps the requests in flight; such levels run on this
    thread's event loop (no generator processes: the schedule has one clock).

    ``on_level(index, metrics)`` is called after each level (from the loop's thread, with no
    request in flight); returning False stops before the next level (the API said prune).
    Setting ``cancel`` from another thread raises LoadgenCancelled within about 100 ms.

    ``processes``: generator processes per level; None picks ``default_processes(concurrency,
    available CPUs)`` per level, 1 keeps everything on this thread's event loop.  A level's
    processes are started before its warm-up and kept for the following levels.

    ``engine_pids``: the engine's processes, for the host check of every level (saturation.py).

    ``slo``: count each pass's requests meeting it (goodput, a study whose objective is goodput).
    """
    if processes is not None and processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    cpus = available_cpus()

    def per_level(concurrency: int) -> int:
        wanted = default_processes(concurrency, cpus) if processes is None else processes
        return min(wanted, concurrency)

    return asyncio.run(
        _run_workload(
            base_url,
            workload,
            prompts,
            cancel=cancel,
            on_level=on_level,
            timeout_s=request_timeout_s,
            per_level=per_level,
            engine_pids=engine_pids,
            output_lens=output_lens,
            slo=slo,
        )
    )


async def _run_workload(
    base_url: str,
    workload: Workload,
    prompts: Sequence[str],
    *,
    cancel: threading.Event | None,
    on_level: Callable[[int, LevelMetrics], bool] | None,
    timeout_s: float,
    per_level: Callable[[int], int],
    engine_pids: Callable[[], Sequence[int]] | None = None,
    output_lens: Sequence[int] | None = None,
    slo: Slo | None = None,
) -> list[LevelMetrics]:
    if output_lens is not None and (len(output_lens) != len(prompts) or min(output_lens, default=1) < 1):
        raise ValueError("output_lens needs one positive length per prompt")
    open_loop = workload.request_rate is not None
    if open_loop:
        per_level = lambda _c: 1  # noqa: E731 - one clock for the arrival schedule
    _check_args(
        prompts,
        min(workload.concurrency),
        workload.num_prompts,
        workload.output_len,
        workload.warmup_requests,
        workload.repeats,
        timeout_s,
    )
    results: list[LevelMetrics] = []
    pool_size = max(per_level(c) for c in workload.concurrency)
    async with make_client(timeout_s) as client:
        # One pool for the whole workload, sized for its largest level; it starts on first use.
        pool = (
            ShardPool(
                pool_size, base_url=base_url, prompts=prompts, request_timeout_s=timeout_s, output_lens=output_lens
            )
            if pool_size > 1
            else None
        )
        try:
            for index, concurrency in enumerate(workload.concurrency):
                raise_if_cancelled(cancel)
                procs = per_level(concurrency)
                if pool is not None and procs > 1:
                    run = _sharded_runner(pool, procs, concurrency, workload.output_len, cancel)
                else:
                    run = _local_runner(
                        client, base_url, prompts, concurrency, workload.output_len, timeout_s, cancel,
                        output_lens=output_lens, request_rate=workload.request_rate,
                    )  # fmt: skip
                metrics = await _measure_level(
                    run,
                    concurrency,
                    workload.num_prompts,
                    workload.warmup_requests,
                    workload.repeats,
                    watch=_watch(
                        client, base_url, concurrency, pool if procs > 1 else None, engine_pids, open_loop=open_loop
                    ),
                    slo=slo,
                )
                results.append(metrics)
                if on_level is not None and not on_level(index, metrics):
                    break
        finally:
            if pool is not None:
                await pool.aclose()
    return results


async def _measure_level(
    run_pass: PassRunner,
    concurrency: int,
    num_prompts: int,
    warmup_requests: int,
    repeats: int,
    watch: Callable[[], LevelWatch] | None = None,
    slo: Slo | None = None,
) -> LevelMetrics:
    """Warm up, run the timed passes; a level the load checks fail is measured once more.

    The second try runs on the same warm server; if it fails too, the level keeps the mark
    (``saturated``) and the reason, and nothing downstream derives an interval from it.
    """
    if warmup_requests:
        await run_pass(warmup_requests, f"c={concurrency} warm-up")
    check = None
    for attempt in range(2 if watch is not None else 1):  # bounded: one re-measurement
        again = " (again: the first try was saturated)" if attempt else ""
        if watch is None:
            passes = [await run_pass(num_prompts, f"c={concurrency} pass {r + 1}/{repeats}") for r in range(repeats)]
            break
        async with watch() as w:
            passes = [
                await run_pass(num_prompts, f"c={concurrency} pass {r + 1}/{repeats}{again}") for r in range(repeats)
            ]
        check = w.check(passes)
        if check.saturated is None:
            break
        log.warning("concurrency %d: saturated measurement (%s)%s", concurrency, check.saturated, again)
    metrics = summarize_level(concurrency, passes, slo)
    if check is None:
        return metrics
    return metrics.model_copy(
        update={
            "saturated": None
            if check.saturated is None
            else f"measured twice, saturated both times: {check.saturated}",
            "load_check": {k: v for k, v in check.as_json().items() if v is not None},
        }
    )


def _local_runner(
    client: httpx.AsyncClient,
    base_url: str,
    prompts: Sequence[str],
    concurrency: int,
    output_len: int,
    timeout_s: float,
    cancel: threading.Event | None,
    *,
    output_lens: Sequence[int] | None = None,
    request_rate: float | None = None,
) -> PassRunner:
    url = base_url.rstrip("/") + "/generate"

    async def run_pass(count: int, phase: str) -> PassResult:
        raise_if_cancelled(cancel)
        next_index = 0
        # Open loop: one Poisson schedule per pass of a level, the same for the baseline, every
        # trial and a re-measurement (named by the phase, without the "again" note).
        arrivals = (
            None
            if request_rate is None
            else arrival_offsets(request_rate, count, key=f"{phase.split(' (again')[0]}/{count}")
        )

        def claim() -> int:
            nonlocal next_index
            next_index += 1
            return next_index - 1

        started = perf_counter()
        done = await run_workers(
            client=client,
            url=url,
            prompts=prompts,
            count=count,
            workers=min(concurrency, count),
            output_len=output_len,
            timeout_s=timeout_s,
            phase=phase,
            claim=claim,
            cancel=cancel,
            output_lens=output_lens,
            arrivals=arrivals,
        )
        wall_s = perf_counter() - started
        return PassResult(wall_s=wall_s, requests=in_request_order(done, count, phase))

    return run_pass


def _sharded_runner(
    pool: ShardPool, processes: int, concurrency: int, output_len: int, cancel: threading.Event | None
) -> PassRunner:
    async def run_pass(count: int, phase: str) -> PassResult:
        raise_if_cancelled(cancel)
        sharded = await pool.run_pass(
            count=count,
            concurrency=concurrency,
            output_len=output_len,
            phase=phase,
            cancel=cancel,
            processes=processes,
        )
        return sharded.result

    return run_pass


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
