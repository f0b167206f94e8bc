"""Did the load generator keep up?  A saturated measurement is not a measurement.

A closed-loop level measures the engine only while the generator sends the next request the
moment one finishes and reads every token as it arrives.  On a busy host (or against a
sped-up simulated engine) the generator falls behind: requests leave late, the engine holds
fewer than ``concurrency`` of them, and the figure measures the host, not the configuration
(issue 17: two identical hosts read 22k and 30k tok/s; speedups came out bimodal).

Three checks per level, over its timed passes (the warm-up excluded):

* **CPU demand** of every generator process: (time on a CPU + time runnable but waiting for
  one) / wall time, from ``/proc/<pid>/schedstat``.  Near 1 the process was never idle waiting
  for the engine: it was the bottleneck, by its own work or by the host's other load.
* **Send lag**: a probe on the event loop asks to wake every ``PROBE_INTERVAL_S`` and records
  how late it woke; every send and every token read waits as long.  Each request slot then
  idles about that long per request, so mean lag / mean request duration is the share of the
  engine's time the generator withheld.
* **The engine's queue**, from its ``/metrics`` (``--enable-metrics``): the running requests it
  held on average, against the ``concurrency`` it should hold, and requests waiting in its queue.
* **The host**, when the caller names the engine's processes: the share of the wall time the
  busiest of them sat runnable but waiting for a CPU.  A GPU engine's scheduler may spin on a
  core (its CPU time says nothing), but waiting for one means the host is oversubscribed and
  the engine's steps ran late: what was measured is the host's load, not the configuration.

A level that fails a check carries the reason (``LevelMetrics.saturated``); the runner measures
it once more on the same warm server and keeps the mark if it fails again.  Everything it reads
is optional: without ``/proc`` or ``/metrics`` those checks say nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter

import httpx

from workers.loadgen.stats import PassResult

# How often the lag probe asks to wake.  Short enough to sample every pass many times, long
# enough to cost nothing (100 wake-ups/s).
PROBE_INTERVAL_S = 0.01
# How often the engine's /metrics is read during a timed pass.
ENGINE_SAMPLE_S = 0.1
# A generator process that needed a CPU this share of the wall time kept up with nothing.
MAX_CPU_DEMAND = 0.9
# Withholding this share of each request's time from the engine biases throughput by about as much.
MAX_LAG_SHARE = 0.10
# The engine held fewer than this share of the requests in flight on average.
MIN_ENGINE_RUNNING_SHARE = 0.75
# An engine process that waited this share of the wall time for a CPU ran on an oversubscribed host.
# Measured on a 2-core box (tests/workers/test_saturation.py's engines): an engine at real time waited
# 0.04 idle and 0.14-0.16 beside a busy loop per core; the sped-up one beside two per core waited
# 0.59-0.66, and its timed passes then disagreed by up to 2.5x.  0.6 let 0.59 through as clean.
MAX_ENGINE_WAIT_SHARE = 0.4
# A pass shorter than this gives the checks too few samples to speak for it.
MIN_CHECK_WALL_S = 0.2

_RUNNING_RE = re.compile(rb"^sglang:num_running_reqs(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)
_QUEUED_RE = re.compile(rb"^sglang:num_queue_reqs(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)

EngineProbe = Callable[[], Awaitable[tuple[float, float] | None]]
"""Returns (running, queued) requests as the engine reports them now, or None."""


def sched_times(pid: int | None = None) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of a process; None off Linux."""
    path = f"/proc/{'self' if pid is None else pid}/schedstat"
    try:
        with open(path, "rb") as f:
            fields = f.read().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def engine_probe(client: httpx.AsyncClient, base_url: str) -> EngineProbe:
    """Reads running and queued requests from the engine's Prometheus text (None when it has none)."""
    url = base_url.rstrip("/") + "/metrics"
    off = False

    async def probe() -> tuple[float, float] | None:
        nonlocal off
        if off:
            return None
        try:
            r = await client.get(url, timeout=2.0)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            off = True  # metrics are off on this server: stop asking
            return None
        running, queued = _RUNNING_RE.search(r.content), _QUEUED_RE.search(r.content)
        if running is None:
            off = True
            return None
        return float(running.group(1)), float(queued.group(1)) if queued else 0.0

    return probe


@dataclass
class LoadCheck:
    """What the checks saw over a level's timed passes, and the verdict."""

    concurrency: int
    wall_s: float = 0.0
    cpu_demand: float | None = None  # worst generator process
    cpu_share: float | None = None  # its own work only
    lag_ms_mean: float | None = None
    lag_share: float | None = None
    engine_running_mean: float | None = None
    engine_queued_max: float | None = None
    engine_wait_share: float | None = None  # busiest engine process
    reasons: list[str] = field(default_factory=list)

    @property
    def saturated(self) -> str | None:
        return "; ".join(self.reasons) if self.reasons else None

    def as_json(self) -> dict[str, float | None]:
        return {
            "cpu_demand": self.cpu_demand,
            "cpu_share": self.cpu_share,
            "send_lag_ms": self.lag_ms_mean,
            "send_lag_share": self.lag_share,
            "engine_running_mean": self.engine_running_mean,
            "engine_queued_max": self.engine_queued_max,
            "engine_wait_share": self.engine_wait_share,
        }


class LevelWatch:
    """Runs the probes around a level's timed passes; ``check()`` gives the verdict.

    ``pids`` returns the generator processes besides this one (the shards of a sharded level);
    ``engine_pids`` the engine's processes (its process group), when the caller knows them.
    """

    def __init__(
        self,
        concurrency: int,
        *,
        pids: Callable[[], Sequence[int]] = lambda: (),
        engine: EngineProbe | None = None,
        engine_pids: Callable[[], Sequence[int]] | None = None,
        open_loop: bool = False,
    ) -> None:
        self.concurrency = concurrency
        # Open loop (a request rate): fewer requests in flight than the cap is the load asked for.
        self.open_loop = open_loop
        self._pids = pids
        self._engine = engine
        self._engine_pids = engine_pids
        self._engine_start: dict[int, tuple[float, float]] = {}
        self._engine_end: dict[int, tuple[float, float]] = {}
        self._lags: list[float] = []
        self._running: list[float] = []
        self._queued: list[float] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._start: dict[int | None, tuple[float, float]] = {}
        self._end: dict[int | None, tuple[float, float]] = {}
        self._t0 = 0.0
        self._wall = 0.0

    def _sample_sched(self) -> dict[int | None, tuple[float, float]]:
        out: dict[int | None, tuple[float, float]] = {}
        for pid in (None, *self._pids()):
            t = sched_times(pid)
            if t is not None:
                out[pid] = t
        return out

    def _sample_engine(self) -> dict[int, tuple[float, float]]:
        out: dict[int, tuple[float, float]] = {}
        for pid in self._engine_pids() if self._engine_pids is not None else ():
            t = sched_times(pid)
            if t is not None:
                out[pid] = t
        return out

    async def __aenter__(self) -> LevelWatch:
        self._engine_start = self._sample_engine()
        self._start = self._sample_sched()
        self._t0 = perf_counter()
        self._tasks.append(asyncio.create_task(self._probe_lag()))
        if self._engine is not None:
            self._tasks.append(asyncio.create_task(self._probe_engine(self._engine)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._wall = perf_counter() - self._t0
        self._end = self._sample_sched()
        self._engine_end = self._sample_engine()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _probe_lag(self) -> None:
        while True:  # cancelled at the end of the level
            asked = perf_counter()
            await asyncio.sleep(PROBE_INTERVAL_S)
            self._lags.append(max(0.0, perf_counter() - asked - PROBE_INTERVAL_S))

    async def _probe_engine(self, probe: EngineProbe) -> None:
        while True:  # cancelled at the end of the level
            await asyncio.sleep(ENGINE_SAMPLE_S)
            got = await probe()
            if got is not None:
                self._running.append(got[0])
                self._queued.append(got[1])

    def check(self, passes: Sequence[PassResult]) -> LoadCheck:
        c = LoadCheck(self.concurrency, wall_s=self._wall)
        if self._wall < MIN_CHECK_WALL_S:
            return c
        demands = []
        for pid, (cpu1, wait1) in self._end.items():
            if pid in self._start:
                cpu0, wait0 = self._start[pid]
                demands.append(((cpu1 - cpu0) / self._wall, (wait1 - wait0) / self._wall))
        if demands:
            cpu, wait = max(demands, key=lambda d: d[0] + d[1])
            c.cpu_demand, c.cpu_share = cpu + wait, cpu
            if c.cpu_demand >= MAX_CPU_DEMAND:
                c.reasons.append(
                    f"the load generator needed a CPU {100 * c.cpu_demand:.0f}% of the time "
                    f"({100 * wait / c.cpu_demand:.0f}% of that waiting for one): it could not keep up"
                )
        waits = [
            (self._engine_end[p][1] - w0) / self._wall
            for p, (_, w0) in self._engine_start.items()
            if p in self._engine_end
        ]
        if waits:
            c.engine_wait_share = max(waits)
            if c.engine_wait_share >= MAX_ENGINE_WAIT_SHARE:
                c.reasons.append(
                    f"the engine waited for a CPU {100 * c.engine_wait_share:.0f}% of the time: the host is "
                    "oversubscribed and its steps ran late"
                )
        durations = [r.e2e_s for p in passes for r in p.requests]
        if self._lags and durations:
            c.lag_ms_mean = 1e3 * sum(self._lags) / len(self._lags)
            mean_request_s = sum(durations) / len(durations)
            c.lag_share = (c.lag_ms_mean / 1e3) / mean_request_s if mean_request_s > 0 else None
            if c.lag_share is not None and c.lag_share >= MAX_LAG_SHARE:
                c.reasons.append(
                    f"requests and tokens waited {c.lag_ms_mean:.1f} ms on average for the load generator, "
                    f"{100 * c.lag_share:.1f}% of a request's {1e3 * mean_request_s:.0f} ms"
                )
        if self._running:
            c.engine_running_mean = sum(self._running) / len(self._running)
            c.engine_queued_max = max(self._queued)
            streams = min(self.concurrency, min((len(p.requests) for p in passes), default=self.concurrency))
            if not self.open_loop and c.engine_running_mean < MIN_ENGINE_RUNNING_SHARE * streams:
                c.reasons.append(
                    f"the engine ran {c.engine_running_mean:.1f} requests on average at concurrency "
                    f"{self.concurrency}: the load generator did not keep them in flight"
                )
        return c
