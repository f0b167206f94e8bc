"""The simulated SGLang server process: start-up emulation, HTTP endpoints, shutdown.

`python -m spectune_sim <SGLang launch flags>` behaves like `python -m sglang.launch_server`
as far as a tuning worker can tell: same flags and resolution, start-up mostly before the port
opens, 503 while warming up, the same log lines, endpoints and streaming format (docs/sglang.md §4-10),
a child process, CUDA OOM at start-up.  Rates come from `spectune_sim.model`.

Environment knobs (all optional):

* SPECTUNE_SIM_SGLANG_VERSION  emulated SGLang version [0.5.23]; decides the accepted flags
* SPECTUNE_SIM_TIME_SCALE      multiplies every start-up duration [1.0]; tests use 0.01-0.05
* SPECTUNE_SIM_SPEED           multiplies every rate [1.0]: cycles last T/speed seconds, so every
                               measured tok/s (and the logged/reported gen throughput) is speed
                               times the model's; divide by it, latencies multiply by it
* SPECTUNE_SIM_NOISE           per-request lognormal sigma [0.02]; 0 makes the run deterministic
* SPECTUNE_SIM_SEED            seed of every random draw [0]
* SPECTUNE_SIM_HOST_ID         host identity for the per-host offset and drift [hostname]
* SPECTUNE_SIM_FAULT           `hang_startup` (the port never opens) or `crash_after:<seconds>`
                               (SIGSEGV that long after ready)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import resource
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from spectune_sim.args import ResolvedArgs, build_parser, resolve
from spectune_sim.engine import Chunk, Engine, EngineOptions, Request, word_of
from spectune_sim.landscapes import Landscape, UnknownLandscapeError, get_landscape
from spectune_sim.lifeline import follow_parent
from spectune_sim.model import (
    GraphEnvelope,
    MemoryCheck,
    NoiseModel,
    StartupPhases,
    check_memory,
    graph_plan,
    startup_phases,
    text_reject_scale,
)
from spectune_sim.rules import DraftTree

log = logging.getLogger("sglang")
DEFAULT_VERSION = "0.5.23"
WARMUP_TOKENS = 8
DRAIN_GRACE_S = 3.0


class _RankFilter(logging.Filter):
    """SGLang tags scheduler-side lines with the TP rank: `[time TP0] ...`."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = " TP0" if record.name.startswith("sglang.scheduler") else ""
        return True


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s%(rank)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    handler.addFilter(_RankFilter())
    root = logging.getLogger("sglang")
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    root.propagate = False


@dataclass(frozen=True)
class SimEnv:
    """The simulator's own knobs (see the module docstring)."""

    version: str = DEFAULT_VERSION
    time_scale: float = 1.0
    speed: float = 1.0
    noise: float = 0.02
    seed: int = 0
    host_id: str = "localhost"
    fault: str | None = None

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> SimEnv:
        def num(key: str, default: float) -> float:
            raw = env.get(key)
            if raw is None or raw == "":
                return default
            try:
                value = float(raw)
            except ValueError:
                raise SystemExit(f"{key}={raw!r} is not a number") from None
            if value < 0 or not math.isfinite(value):
                raise SystemExit(f"{key}={raw!r} must be a finite number >= 0")
            return value

        speed = num("SPECTUNE_SIM_SPEED", 1.0)
        if speed == 0:
            raise SystemExit("SPECTUNE_SIM_SPEED must be > 0 (it multiplies every rate)")
        fault = env.get("SPECTUNE_SIM_FAULT") or None
        if fault is not None and fault != "hang_startup" and not fault.startswith("crash_after:"):
            raise SystemExit(f"SPECTUNE_SIM_FAULT={fault!r}: use 'hang_startup' or 'crash_after:<seconds>'")
        return cls(
            version=env.get("SPECTUNE_SIM_SGLANG_VERSION") or DEFAULT_VERSION,
            time_scale=num("SPECTUNE_SIM_TIME_SCALE", 1.0),
            speed=speed,
            noise=num("SPECTUNE_SIM_NOISE", 0.02),
            seed=int(num("SPECTUNE_SIM_SEED", 0)),
            host_id=env.get("SPECTUNE_SIM_HOST_ID") or socket.gethostname(),
            fault=fault,
        )

    @property
    def crash_after_s(self) -> float | None:
        if self.fault is None or not self.fault.startswith("crash_after:"):
            return None
        try:
            return float(self.fault.split(":", 1)[1])
        except ValueError:
            raise SystemExit(
                f"SPECTUNE_SIM_FAULT={self.fault!r}: the delay must be seconds, e.g. crash_after:2"
            ) from None


class PrefixCache:
    """SGLang's radix cache, as far as token ids go: the longest cached prefix of a prompt.

    A trie of the prompts sent as `input_ids` (text prompts are not cached: the simulator has no
    tokenizer, and the benchmark's own passes must stay uncached as they were calibrated).  Each
    prompt is inserted when it is submitted; past `max_tokens` stored tokens the cache is emptied
    (SGLang evicts by LRU; a probe's prefix is re-warmed by its next request).
    """

    def __init__(self, max_tokens: int = 1_000_000) -> None:
        self.max_tokens = max_tokens
        self._root: dict[int, Any] = {}
        self._stored = 0

    def match_and_insert(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` were cached; `ids` is cached afterwards."""
        if self._stored + len(ids) > self.max_tokens:
            self.clear()
        node, matched = self._root, 0
        for token in ids:
            child = node.get(token)
            if child is None:
                break
            node, matched = child, matched + 1
        for token in ids[matched:]:
            child = node[token] = {}
            node = child
            self._stored += 1
        return matched

    def clear(self) -> None:
        self._root, self._stored = {}, 0


class OutOfMemoryError(RuntimeError):
    """Printed as torch prints its own, so log scanners see the real line."""


OutOfMemoryError.__module__ = "torch"


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: the simulator drains on SIGTERM itself and exits 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class SimServer:
    """One simulated server: lifecycle, state and the HTTP app."""

    def __init__(self, env: SimEnv, landscape: Landscape, resolved: ResolvedArgs, argv: list[str]) -> None:
        self.env = env
        self.landscape = landscape
        self.r = resolved
        self.argv = argv
        self.state = "starting"  # starting -> warming -> ready -> draining
        self.started_at = time.monotonic()
        self.startup_time: float | None = None
        self.stop_event = asyncio.Event()
        self.spec = (
            None
            if not resolved.speculative
            else DraftTree(
                num_steps=resolved.num_steps or 1,
                topk=resolved.topk or 1,
                num_draft_tokens=resolved.num_draft_tokens or 2,
            )
        )
        # An adaptive server holds a draft state (and graphs) for its deepest chain: its memory and
        # start-up are modelled with that chain; each batch then runs its slot's steps (engine).
        built = self.spec
        if resolved.adaptive is not None and resolved.adaptive.largest_steps > 0:
            deepest = resolved.adaptive.largest_steps
            built = DraftTree(num_steps=deepest, topk=1, num_draft_tokens=deepest + 1)
        # The graph envelope the server was started with, as every memory and start-up figure needs it.
        envelope: GraphEnvelope = {
            "cuda_graph_max_bs": resolved.cuda_graph_max_bs,
            "max_running_requests": resolved.max_running_requests,
            "cuda_graph_bs": resolved.cuda_graph_bs,
            "disable_cuda_graph": resolved.disable_cuda_graph,
        }
        self.plan = graph_plan(landscape, speculative=self.spec is not None, **envelope)
        self.memory: MemoryCheck = check_memory(
            landscape, built, mem_fraction_static=float(resolved.values["mem_fraction_static"]), **envelope
        )
        self.phases: StartupPhases = startup_phases(landscape, built, **envelope)
        infeasible = self.spec is not None and not self.spec.fillable
        self.engine = Engine(
            EngineOptions(
                landscape=landscape,
                spec=self.spec,
                plan=self.plan,
                speed=env.speed,
                noise=NoiseModel(sigma=env.noise).scaled(landscape.noise_scale),
                seed=env.seed,
                host_id=env.host_id,
                decode_log_interval=max(1, int(resolved.values["decode_log_interval"])),
                draft_mismatch=resolved.draft_mismatch,
                draft_extend_graph=os.environ.get("SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH", "0") not in ("1", "true"),
                infeasible=infeasible,
                adaptive=resolved.adaptive,
            ),
            logging.getLogger("sglang.scheduler"),
        )
        self.served_model_name = str(resolved.values["served_model_name"])
        self.prefix_cache = PrefixCache()

    # -- lifecycle -------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        child = _spawn_child()
        try:
            return await self._lifecycle()
        finally:
            _stop_child(child)

    def _on_stop_signal(self, sig: signal.Signals) -> None:
        log.info("Received %s; shutting down (draining in-flight requests).", sig.name)
        if self.state != "starting":
            self.state = "draining"
        self.stop_event.set()

    async def _pause(self, seconds: float) -> bool:
        """Sleep `seconds` of scaled start-up time; False when a stop signal came first."""
        try:
            await asyncio.wait_for(self.stop_event.wait(), timeout=max(0.0, seconds * self.env.time_scale))
            return False
        except TimeoutError:
            return True

    async def _lifecycle(self) -> int:
        v = self.r.values
        # The command line as this server received it (also /server_info's launch_command).
        log.info("launch_command=%s", shlex.join([sys.executable, "-m", "spectune_sim", *self.argv]))
        log.info("server_args=ServerArgs(%s)", ", ".join(f"{k}={v[k]!r}" for k in sorted(v)))
        for w in self.r.warnings:
            log.warning(w)
        if self.env.fault == "hang_startup":
            log.info("Load weight begin. avail mem=%.2f GB", self.landscape.gpu_memory_gb - 0.5)
            await self.stop_event.wait()  # a hung NCCL init: the port never opens
            return 0
        if not await self._startup_before_port():
            return 0 if self.stop_event.is_set() else 1
        return await self._serve()

    async def _startup_before_port(self) -> bool:
        ls, ph, mem = self.landscape, self.phases, self.memory
        sched = logging.getLogger("sglang.scheduler")
        sched.info("Load weight begin. avail mem=%.2f GB", ls.gpu_memory_gb - 0.5)
        if not await self._pause(ph.load_s):
            return False
        if mem.failure == "weights":
            self._oom(ls.weights_gb, 0.3)
            return False
        sched.info(
            "Load weight end. type=%s, dtype=torch.bfloat16, avail mem=%.2f GB, mem usage=%.2f GB.",
            ls.architecture,
            ls.gpu_memory_gb - ls.weights_gb - 0.5,
            ls.weights_gb,
        )
        if self.spec is not None:
            sched.info("Load draft weight end. mem usage=%.2f GB.", mem.draft_gb)
        if not await self._pause(ph.init_s):
            return False
        if mem.failure == "kv_cache":
            sched.error(
                "Scheduler hit an exception: RuntimeError: Not enough memory. Please try to increase "
                "--mem-fraction-static. (KV pool %.2f GB < %.2f GB needed)",
                mem.kv_pool_gb,
                ls.kv_min_gb,
            )
            return False
        sched.info("KV Cache is allocated. #tokens: %d, KV size: %.2f GB", mem.token_capacity, mem.kv_pool_gb)
        if self.r.disable_cuda_graph:
            sched.info("CUDA graph is disabled; decode runs eagerly.")
        else:
            avail = mem.graph_available_gb
            used = 0.0
            if self.spec is None:
                phases = [("decode", "Capture cuda graph", ph.capture_decode_s, mem.graph_decode_gb)]
            else:
                phases = [
                    ("target_verify", "Capture cuda graph", ph.capture_target_verify_s, mem.graph_target_verify_gb),
                    ("draft_decode", "Capture draft cuda graph", ph.capture_draft_decode_s, mem.graph_draft_decode_gb),
                    (
                        "draft_extend",
                        "Capture draft extend cuda graph",
                        ph.capture_draft_extend_s,
                        mem.graph_draft_extend_gb,
                    ),
                ]
            for _, label, secs, gb in phases:
                if secs == 0 and gb == 0:
                    continue
                sched.info(
                    "%s begin. This can take up to several minutes. avail mem=%.2f GB, bs=%s",
                    label,
                    avail - used,
                    list(self.plan.sizes),
                )
                if used + gb > avail:
                    # Fail part-way through this phase, where the allocations cross the limit.
                    frac = max(0.0, (avail - used) / gb) if gb > 0 else 0.0
                    if not await self._pause(secs * frac):
                        return False
                    self._oom(gb - max(0.0, avail - used), max(0.0, avail - used))
                    return False
                if not await self._pause(secs):
                    return False
                used += gb
                sched.info(
                    "%s end. Time elapsed: %.2f s. mem usage=%.2f GB. avail mem=%.2f GB.",
                    label,
                    secs * self.env.time_scale,
                    gb,
                    avail - used,
                )
        return await self._pause(ph.prefill_graph_s)

    def _oom(self, tried_gb: float, free_gb: float) -> None:
        total = self.landscape.gpu_memory_gb
        err = OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {max(tried_gb, 0.02):.2f} GiB. GPU 0 has a total capacity of "
            f"{total:.2f} GiB of which {free_gb * 1024:.2f} MiB is free. Including non-PyTorch memory, this "
            f"process has {total - free_gb:.2f} GiB memory in use. Of the allocated memory "
            f"{total - free_gb - 0.4:.2f} GiB is allocated by PyTorch, and 0.31 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
        )
        logging.getLogger("sglang.scheduler").error(
            "Scheduler hit an exception: Traceback (most recent call last):\n"
            '  File "sglang/srt/managers/scheduler.py", line 3110, in run_scheduler_process\n'
            '  File "sglang/srt/model_executor/cuda_graph_runner.py", line 412, in capture\n'
            "%s: %s",
            f"{type(err).__module__}.{type(err).__name__}",
            err,
        )
        log.error("Received sigquit from a child process. It usually means the child failed.")

    async def _serve(self) -> int:
        # IPPROTO_TCP explicitly: asyncio disables Nagle's algorithm on accepted connections only
        # when the listening socket's proto says TCP.  With proto 0 the first and last chunks of a
        # stream wait ~40 ms for delayed ACKs on keep-alive connections, which SGLang (uvloop,
        # TCP_NODELAY) never does, and TTFT and tok/s would be off by up to 8%.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        host, port = str(self.r.values["host"]), int(self.r.values["port"])
        try:
            sock.bind((host, port))
        except OSError as e:
            log.error("Cannot bind %s:%d (%s); pick a free --port.", host, port, e)
            sock.close()
            return 1
        config = uvicorn.Config(
            build_app(self), log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2
        )
        server = _QuietServer(config)
        engine_task = asyncio.create_task(self.engine.run(), name="scheduler")
        serve_task = asyncio.create_task(server.serve(sockets=[sock]), name="http")
        self.state = "warming"
        log.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", host, port)
        code = 0
        try:
            if await self._pause(self.landscape.warmup_s) and not self.stop_event.is_set():
                if not self.r.values["skip_server_warmup"]:
                    await self._warmup()
                if not self.stop_event.is_set():
                    self.engine.failure_armed = True
                    self.state = "ready"
                    self.startup_time = time.monotonic() - self.started_at
                    log.info("The server is fired up and ready to roll!")
                    crash = self.env.crash_after_s
                    if crash is not None:
                        asyncio.get_running_loop().call_later(crash, _die_like_segfault)
            stop_wait = asyncio.create_task(self.stop_event.wait())
            done, _ = await asyncio.wait({stop_wait, serve_task}, return_when=asyncio.FIRST_COMPLETED)
            if serve_task in done:
                log.error("HTTP server stopped unexpectedly: %r", serve_task.exception())
                code = 1
            stop_wait.cancel()
            self.state = "draining"
            await self._drain()
        finally:
            server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(serve_task, timeout=5)
            engine_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await engine_task
        return code

    async def _warmup(self) -> None:
        req = self.engine.submit(6, WARMUP_TOKENS, ignore_eos=True)
        while True:
            chunk = await req.queue.get()
            if chunk.finished:
                return

    async def _drain(self) -> None:
        deadline = time.monotonic() + DRAIN_GRACE_S
        while not self.engine.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.engine.abort_all("server is shutting down")

    # -- reports ----------------------------------------------------------------------------------

    def server_info(self) -> dict[str, Any]:
        c = self.engine.counters
        mem = self.memory
        args = {k: _jsonable(val) for k, val in self.r.values.items()}
        internal = dict(args)
        internal.update(
            avg_spec_accept_length=c.avg_spec_accept_length,
            last_gen_throughput=c.last_gen_throughput,
            effective_max_running_requests_per_dp=self.r.max_running_requests,
            memory_usage={
                "weight": round(mem.weights_gb + mem.draft_gb, 2),
                "kvcache": round(mem.kv_pool_gb, 2),
                "token_capacity": mem.token_capacity,
                "graph": {
                    "decode": round(mem.graph_decode_gb, 3),
                    "target_verify": round(mem.graph_target_verify_gb, 3),
                    "draft_decode": round(mem.graph_draft_decode_gb, 3),
                    "draft_extend": round(mem.graph_draft_extend_gb, 3),
                },
            },
        )
        return {
            **args,
            "cuda_graph_bs": list(self.plan.sizes),
            "launch_command": shlex.join([sys.executable, "-m", "spectune_sim", *self.argv]),
            "version": self.env.version,
            "startup_time": self.startup_time,
            "status": self.state,
            "internal_states": [internal],
            "spectune_simulator": {
                "landscape": self.landscape.name,
                "speed": self.env.speed,
                "time_scale": self.env.time_scale,
                "noise": self.env.noise,
                "seed": self.env.seed,
                "host_id": self.env.host_id,
                "expected_accept_length": self.engine.expected_accept_length,
            },
        }

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.r.values["model_path"],
            "tokenizer_path": self.r.values["tokenizer_path"],
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.landscape.architecture,
            "architectures": [self.landscape.architecture],
        }

    def metrics_text(self) -> str:
        c = self.engine.counters
        label = f'{{model_name="{self.served_model_name}"}}'
        spec = self.spec
        rate = 0.0
        if spec is not None and c.published_verify_calls:
            rate = (c.avg_spec_accept_length - 1) / max(1, spec.num_draft_tokens - 1)
        lines: list[str] = []

        def metric(name: str, kind: str, value: float, help_text: str) -> None:
            lines.extend(
                [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} {kind}", f"sglang:{name}{label} {value}"]
            )

        metric("num_running_reqs", "gauge", c.num_running, "The number of running requests.")
        metric("num_queue_reqs", "gauge", c.num_waiting, "The number of requests in the waiting queue.")
        metric("gen_throughput", "gauge", c.last_gen_throughput, "The generation throughput (token/s).")
        metric(
            "spec_accept_length",
            "gauge",
            c.avg_spec_accept_length,
            "The average acceptance length of speculative decoding.",
        )
        metric("spec_accept_rate", "gauge", rate, "The average acceptance rate of speculative decoding.")
        metric("spec_num_steps", "gauge", spec.num_steps if spec else 0, "speculative_num_steps.")
        metric("spec_num_draft_tokens", "gauge", spec.num_draft_tokens if spec else 0, "speculative_num_draft_tokens.")
        metric(
            "is_cuda_graph",
            "gauge",
            1.0 if c.cuda_graph and not self.r.disable_cuda_graph else 0.0,
            "Whether the last batch used a CUDA graph.",
        )
        metric("graph_memory_usage_gb", "gauge", round(self.memory.graph_gb, 3), "CUDA graph memory (GB).")
        metric("generation_tokens_total", "counter", c.generation_tokens, "Number of generation tokens processed.")
        metric("prompt_tokens_total", "counter", c.prompt_tokens, "Number of prefill tokens processed.")
        metric("spec_verify_calls_total", "counter", c.verify_calls, "Number of speculative verify forward passes.")
        metric("num_requests_total", "counter", c.requests_finished, "Number of requests finished.")
        ph = self.phases
        lines += ["# HELP sglang:startup_cuda_graph_time_seconds CUDA graph capture time by phase.",
                  "# TYPE sglang:startup_cuda_graph_time_seconds gauge"]  # fmt: skip
        for phase, secs in (
            ("decode", ph.capture_decode_s),
            ("target_verify", ph.capture_target_verify_s),
            ("draft_decode", ph.capture_draft_decode_s),
            ("draft_extend", ph.capture_draft_extend_s),
        ):
            lines.append(
                f'sglang:startup_cuda_graph_time_seconds{{model_name="{self.served_model_name}",phase="{phase}"}} '
                f"{secs * self.env.time_scale}"
            )
        lines += _histogram("e2e_request_latency_seconds", c.e2e_latencies, label, "End-to-end request latency.")
        lines += _histogram("time_to_first_token_seconds", c.ttfts, label, "Time to first token.")
        return "\n".join(lines) + "\n"


_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _histogram(name: str, values: list[float], label: str, help_text: str) -> list[str]:
    inner = label[1:-1]
    out = [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} histogram"]
    for b in _BUCKETS:
        out.append(f'sglang:{name}_bucket{{{inner},le="{b}"}} {sum(1 for v in values if v <= b)}')
    out.append(f'sglang:{name}_bucket{{{inner},le="+Inf"}} {len(values)}')
    out.append(f"sglang:{name}_sum{label} {sum(values)}")
    out.append(f"sglang:{name}_count{label} {len(values)}")
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value


# -- HTTP -----------------------------------------------------------------------------------------


def build_app(sim: SimServer) -> Starlette:
    def _ready() -> bool:
        return sim.state == "ready" and sim.engine.failed is None

    async def health(request: HttpRequest) -> Response:
        return Response(status_code=200 if _ready() else 503)

    async def health_generate(request: HttpRequest) -> Response:
        if not _ready():
            return Response(status_code=503)
        if not sim.engine.idle:
            return Response(status_code=200)  # recent progress: no probe needed
        req = sim.engine.submit(4, 1, ignore_eos=True)
        try:
            await asyncio.wait_for(_until_finished(req), timeout=20)
        except TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200 if _ready() else 503)

    async def ready(request: HttpRequest) -> Response:
        if _ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": sim.state}, status_code=503)

    async def server_info(request: HttpRequest) -> Response:
        return JSONResponse(sim.server_info())

    async def model_info(request: HttpRequest) -> Response:
        return JSONResponse(sim.model_info())

    async def models(request: HttpRequest) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": sim.served_model_name,
                        "object": "model",
                        "owned_by": "sglang",
                        "root": sim.served_model_name,
                    }
                ],
            }
        )

    async def metrics(request: HttpRequest) -> Response:
        if not sim.r.values["enable_metrics"]:
            return PlainTextResponse("metrics are off; start the server with --enable-metrics\n", status_code=404)
        return PlainTextResponse(sim.metrics_text(), media_type="text/plain; version=0.0.4")

    async def flush_cache(request: HttpRequest) -> Response:
        sim.prefix_cache.clear()
        return PlainTextResponse("Cache flushed.\n")

    async def generate(request: HttpRequest) -> Response:
        body = await _json_body(sim, request)
        if isinstance(body, Response):
            return body
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        params = body.get("sampling_params") or {}
        text, input_ids = body.get("text"), body.get("input_ids")
        if text is None and input_ids is None:
            return _error(400, "Either text or input_ids should be provided.")
        prompts = _prompt_lengths(text if text is not None else input_ids, is_ids=text is None)
        if prompts is None:
            return _error(400, "text must be a string (or a list of strings); input_ids a list of ints")
        try:
            max_new = int(params.get("max_new_tokens", 128))
            ignore_eos = bool(params.get("ignore_eos", False))
        except (TypeError, ValueError):
            return _error(400, "sampling_params.max_new_tokens must be an integer")
        stream = bool(body.get("stream", False))
        too_long = _context_refusal(sim, prompts, max_new)
        if too_long is not None:
            return _error(400, too_long)
        # Prompts given as ids extend what the prefix cache holds (a batch's prompts in order).
        cached = _cached_tokens(sim, input_ids) if text is None else None
        if isinstance(prompts, list):
            if stream:
                return _error(400, "the simulator streams one prompt per request; send a single text")
            reqs = [
                sim.engine.submit(n, max_new, ignore_eos=ignore_eos, cached_tokens=cached[i] if cached else 0)
                for i, n in enumerate(prompts)
            ]
            outs = await asyncio.gather(*(_collect(sim, r) for r in reqs))
            errors = [o for o in outs if "error" in o]
            return JSONResponse(errors[0], status_code=500) if errors else JSONResponse(outs)
        scale = text_reject_scale(text) if isinstance(text, str) else 1.0
        req = sim.engine.submit(
            prompts, max_new, ignore_eos=ignore_eos, reject_scale=scale, cached_tokens=cached[0] if cached else 0
        )
        if not stream:
            out = await _collect(sim, req)
            return JSONResponse(out, status_code=500 if "error" in out else 200)
        return StreamingResponse(_sse_generate(sim, req), media_type="text/event-stream")

    async def completions(request: HttpRequest) -> Response:
        body = await _json_body(sim, request)
        if isinstance(body, Response):
            return body
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if prompt is None:
            return _error(400, "prompt is required")
        n_prompt = _prompt_lengths(prompt, is_ids=isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))
        if not isinstance(n_prompt, int):
            return _error(400, "the simulator takes one prompt per completion request")
        max_new = int(body.get("max_tokens") or 16)
        req = sim.engine.submit(n_prompt, max_new, ignore_eos=bool(body.get("ignore_eos", False)))
        model = str(body.get("model") or sim.served_model_name)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage")) or bool(
                sim.r.values["stream_response_default_include_usage"]
            )
            return StreamingResponse(_sse_completions(sim, req, model, include_usage), media_type="text/event-stream")
        out = await _collect(sim, req)
        if "error" in out:
            return JSONResponse(out, status_code=500)
        return JSONResponse(
            {
                "id": req.rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": out["text"],
                        "logprobs": None,
                        "finish_reason": _openai_reason(req),
                        "matched_stop": None,
                    }
                ],
                "usage": _usage(req),
            }
        )

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["POST", "GET"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


async def _json_body(sim: SimServer, request: HttpRequest) -> Any:
    """A generation request's JSON body, or the answer instead of one: 503 while the server
    drains, 400 when the body is not JSON."""
    if sim.state == "draining":
        return _error(503, "The server is shutting down.")
    try:
        return await request.json()
    except ValueError:
        return _error(400, "the request body is not JSON")


def _context_refusal(sim: SimServer, prompts: int | list[int], max_new: int) -> str | None:
    """SGLang's 400 for a request that does not fit the context (its tokenizer manager refuses it
    before scheduling, in these words), or None."""
    context = int(sim.r.values["context_length"])
    for n in prompts if isinstance(prompts, list) else [prompts]:
        if n >= context:
            return f"The input ({n} tokens) is longer than the model's context length ({context} tokens)."
        if n + max_new > context:
            return (
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
                f"requested a total of {n + max_new} tokens: {n} tokens from the input messages and {max_new} "
                "tokens for the completion. Please reduce the number of tokens in the input messages or the "
                "completion to fit within the limit."
            )
    return None


def _prompt_lengths(prompt: Any, *, is_ids: bool) -> int | list[int] | None:
    """Prompt token counts: ids count as they are; text at ~4 characters per token."""
    if is_ids:
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return max(1, len(prompt))
        if isinstance(prompt, list) and all(isinstance(x, list) for x in prompt):
            return [max(1, len(x)) for x in prompt]
        return None
    if isinstance(prompt, str):
        return max(1, len(prompt) // 4)
    if isinstance(prompt, list) and all(isinstance(t, str) for t in prompt):
        return [max(1, len(t) // 4) for t in prompt]
    return None


def _cached_tokens(sim: SimServer, input_ids: Any) -> list[int]:
    """Per prompt of a request's `input_ids` (one list of ints, or a batch of them), its tokens
    found in the prefix cache; each prompt is cached afterwards."""
    batch = [input_ids] if input_ids and all(isinstance(t, int) for t in input_ids) else input_ids
    return [sim.prefix_cache.match_and_insert(ids) for ids in batch]


async def _until_finished(req: Request) -> None:
    while not (await req.queue.get()).finished:
        pass


def _meta(sim: SimServer, req: Request, *, final: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason if final else None,
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
    }
    if final:
        end = req.finished_at if req.finished_at is not None else time.monotonic()
        meta["e2e_latency"] = end - req.created
        spec = sim.spec
        if spec is not None:
            proposed = req.verify_ct * (spec.num_draft_tokens - 1)
            meta.update(
                spec_verify_ct=req.verify_ct,
                spec_accept_length=len(req.output_ids) / req.verify_ct if req.verify_ct else 0.0,
                spec_accept_rate=req.correct_drafts / proposed if proposed else 0.0,
                spec_num_correct_drafts=req.correct_drafts,
                spec_num_proposed_drafts=proposed,
            )
    return meta


async def _collect(sim: SimServer, req: Request) -> dict[str, Any]:
    while True:
        chunk = await req.queue.get()
        if chunk.error is not None:
            return {"error": {"message": chunk.error, "code": 500}}
        if chunk.finished:
            break
    return {
        "text": "".join(word_of(t) for t in req.output_ids),
        "output_ids": list(req.output_ids),
        "meta_info": _meta(sim, req, final=True),
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _sse_generate(sim: SimServer, req: Request) -> AsyncIterator[bytes]:
    incremental = bool(sim.r.values["incremental_streaming_output"])
    text_parts: list[str] = []
    sent_ids = 0
    try:
        while True:
            chunk: Chunk = await req.queue.get()
            if chunk.error is not None:
                yield _sse({"error": {"message": chunk.error, "code": 500}})
                break
            delta = "".join(word_of(t) for t in chunk.new_ids)
            text_parts.append(delta)
            n = len(req.output_ids) if chunk.finished else sent_ids + len(chunk.new_ids)
            ids = req.output_ids[sent_ids:n] if incremental else req.output_ids[:n]
            meta = _meta(sim, req, final=chunk.finished)
            meta["completion_tokens"] = n  # the engine may already be a cycle ahead of this client
            event = {"text": delta if incremental else "".join(text_parts), "output_ids": list(ids), "meta_info": meta}
            sent_ids = n
            yield _sse(event)
            if chunk.finished:
                break
        yield b"data: [DONE]\n\n"
    finally:
        sim.engine.abort(req)


async def _sse_completions(sim: SimServer, req: Request, model: str, include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    base = {"id": req.rid, "object": "text_completion", "created": created, "model": model}
    try:
        while True:
            chunk = await req.queue.get()
            if chunk.error is not None:
                yield _sse({"error": {"message": chunk.error, "code": 500}})
                break
            choice = {
                "index": 0,
                "text": "".join(word_of(t) for t in chunk.new_ids),
                "logprobs": None,
                "finish_reason": _openai_reason(req) if chunk.finished else None,
                "matched_stop": None,
            }
            yield _sse({**base, "choices": [choice], "usage": None})
            if chunk.finished:
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(req)})
                break
        yield b"data: [DONE]\n\n"
    finally:
        sim.engine.abort(req)


def _openai_reason(req: Request) -> str | None:
    if req.finish_reason is None:
        return None
    return "length" if req.finish_reason.get("type") == "length" else "stop"


def _usage(req: Request) -> dict[str, int]:
    return {
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": len(req.output_ids),
        "total_tokens": req.prompt_tokens + len(req.output_ids),
    }


# -- processes ------------------------------------------------------------------------------------


def _spawn_child() -> subprocess.Popen[bytes]:
    """SGLang runs its scheduler and detokenizer as children; so does the simulator (one stand-in)."""
    return subprocess.Popen(
        [sys.executable, "-m", "spectune_sim.child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        close_fds=True,
    )


def _stop_child(child: subprocess.Popen[bytes]) -> None:
    if child.stdin is not None:
        with contextlib.suppress(OSError):
            child.stdin.close()  # EOF: the child exits by itself
    try:
        child.wait(timeout=3)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(timeout=3)


def _die_like_segfault() -> None:
    log.error("Fatal Python error: Segmentation fault (SPECTUNE_SIM_FAULT crash_after)")
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the working directory
    os.kill(os.getpid(), signal.SIGSEGV)


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Entry point of `python -m spectune_sim`; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    env = SimEnv.from_environ(os.environ if environ is None else environ)
    configure_logging()
    # A worker SIGKILLed leaves its engine behind; the simulator follows its worker (real SGLang
    # relies on systemd's cgroup for that).
    follow_parent(os.environ if environ is None else environ)
    ns = build_parser(env.version).parse_args(args)  # exits 2 on a bad flag, like SGLang
    configure_logging(str(ns.log_level))
    try:
        landscape = get_landscape(str(ns.model_path))
    except UnknownLandscapeError as e:
        log.error("ValueError: %s", e)
        return 1
    resolved = resolve(ns, landscape, env.version)  # SGLang's own exceptions surface as tracebacks
    sim = SimServer(env, landscape, resolved, args)
    return asyncio.run(sim.run())
