"""How many output tokens/s can the load generator consume on one core?  (Run by hand.)

    python benchmarks/loadgen_capacity.py            # full table (about a minute)
    python benchmarks/loadgen_capacity.py --quick    # fewer, shorter scenarios
    python benchmarks/loadgen_capacity.py --pin 2,3 --practical-tok-s 8270   # as in benchmarks/README.md
    python benchmarks/loadgen_capacity.py --processes 4 --practical-tok-s 8270   # + sharded rows

A minimal server in a separate process speaks SGLang's native ``/generate`` streaming format
(cumulative ``text`` of ~4 characters per token, ``meta_info`` with the running
``completion_tokens``, final chunk with ``spec_verify_ct``, then ``data: [DONE]``), with
pre-encoded events so that it costs as little CPU as possible.  The load generator
(``workers.loadgen.run_level``) runs in this process, on one event loop, i.e. one core.

Two kinds of scenario:

- ``flood``: the server writes events as fast as it can.  Reads coalesce several events, so this
  is the generator's best case (and may be bound by the server on a busy machine).
- ``stepped``: at the practical peak rate, every stream gets one event per step of a shared
  clock, as an engine emits every running request's tokens after each decode step: realistic.
- ``paced``: the same rate, but each stream ticks on its own, so nearly every event arrives in
  its own socket read and loop wake-up: the generator's worst case per token.

For each scenario the table shows the measured tok/s, the generator's CPU time as a share of one
core, and its capacity = tokens consumed / generator CPU seconds, i.e. the tok/s it could consume
if it had a core to itself.  The last column compares that capacity with ``--practical-tok-s``,
the highest aggregate rate it measures in practice (the simulator's landscapes top out at a few
thousand tok/s), and the benchmark says whether every scenario keeps the 10x margin.

``--processes N`` adds the stepped and paced scenarios run as ``run_workload`` runs a high
concurrency level on a host with cores to spare: the streams spread over N generator processes
(``workers.loadgen.shards.ShardPool``).  There, "gen CPU" is the busiest process's share of a
core and capacity = tokens / that process's CPU seconds: the rate at which the first of them
would saturate its core, each process having a core of its own (``--shard-cpus`` pins them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from workers.loadgen import make_client, run_level  # noqa: E402
from workers.loadgen.shards import ShardPool  # noqa: E402

_CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# The server (runs in a child process: `loadgen_capacity.py --serve`)

_EVENT_CACHE: dict[tuple[int, int], list[bytes]] = {}


def _events(output_len: int, burst: int) -> list[bytes]:
    """Pre-encoded HTTP chunks (one SSE event each) for a request, cumulative like SGLang."""
    key = (output_len, burst)
    if key not in _EVENT_CACHE:
        frames: list[bytes] = []
        total = cycles = 0
        while total < output_len:
            total = min(output_len, total + burst)
            cycles += 1
            meta: dict[str, object] = {
                "id": "0123456789abcdef",
                "finish_reason": None,
                "prompt_tokens": 40,
                "completion_tokens": total,
                "cached_tokens": 0,
            }
            if total == output_len:
                meta.update(
                    finish_reason={"type": "length", "length": output_len},
                    e2e_latency=1.0,
                    spec_verify_ct=cycles,
                    spec_accept_length=total / cycles,
                )
            frames.append(_frame(json.dumps({"text": "word" * total, "meta_info": meta}).encode()))
        frames.append(_frame(b"[DONE]") + b"0\r\n\r\n")
        _EVENT_CACHE[key] = frames
    return _EVENT_CACHE[key]


def _frame(payload: bytes) -> bytes:
    data = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        for _ in range(1_000_000):  # keep-alive, bounded
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
            body = json.loads(await reader.readexactly(length))
            words = dict(w.split("=", 1) for w in body["text"].split())
            frames = _events(int(body["sampling_params"]["max_new_tokens"]), int(words["burst"]))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            rate = float(words["rate"])  # tok/s per stream; 0 = flood
            if words.get("mode") == "stepped":
                period = int(words["burst"]) / rate
                for f in frames:
                    await _tick(period)
                    writer.write(f)
                    await writer.drain()
            elif rate <= 0:
                for f in frames:
                    writer.write(f)
                    await writer.drain()
            else:
                interval = int(words["burst"]) / rate
                start = time.perf_counter()
                for i, f in enumerate(frames):
                    delay = start + i * interval - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    writer.write(f)
                    await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


_TICKS: dict[float, asyncio.Future[None]] = {}


async def _tick(period: float) -> None:
    """Wait for the next step of a clock shared by every stream with this period (a decode step)."""
    if period not in _TICKS:
        _TICKS[period] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().create_task(_ticker(period))
    await _TICKS[period]


async def _ticker(period: float) -> None:
    loop = asyncio.get_running_loop()
    due = time.perf_counter()
    for _ in range(10**9):  # lives as long as the server process
        due += period
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        fut, _TICKS[period] = _TICKS[period], loop.create_future()
        fut.set_result(None)


async def _serve() -> None:
    server = await asyncio.start_server(_handle, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    # Exit when the parent closes our stdin (or dies): no orphan server.
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    server.close()


# ---------------------------------------------------------------------------------------------
# The measurement


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    burst: int  # tokens per event (a verify cycle under speculation)
    output_len: int
    num_prompts: int
    rate_per_stream: float  # tok/s each stream emits; 0 = flood
    transport: str = "fast"  # "fast": make_client(), as run_workload uses; "httpx": plain httpx streaming
    processes: int = 1  # > 1: the streams spread over this many generator processes (fast path)

    @property
    def client(self) -> str:
        return f"fast x{self.processes}" if self.processes > 1 else self.transport


@dataclass(frozen=True)
class Row:
    scenario: Scenario
    tok_s: float
    cpu_share: float
    capacity_tok_s: float
    server_cpu_share: float


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime + stime


async def _measure(url: str, sc: Scenario, server_pid: int) -> Row:
    client: httpx.AsyncClient
    if sc.transport == "fast":
        client = make_client(120.0)
    else:
        limits = httpx.Limits(max_connections=sc.concurrency, max_keepalive_connections=sc.concurrency)
        client = httpx.AsyncClient(limits=limits, timeout=120.0, trust_env=False)
    async with client:
        prompt = f"burst={sc.burst} rate={sc.rate_per_stream} mode={sc.name}"
        kw = {"concurrency": sc.concurrency, "output_len": sc.output_len, "request_timeout_s": 120.0}
        await run_level(client, url, [prompt], num_prompts=sc.concurrency, warmup_requests=0, repeats=1, **kw)  # type: ignore[arg-type]
        cpu0, srv0, wall0 = time.process_time(), _proc_cpu_s(server_pid), time.perf_counter()
        m = await run_level(client, url, [prompt], num_prompts=sc.num_prompts, warmup_requests=0, repeats=1, **kw)  # type: ignore[arg-type]
        cpu, srv, wall = time.process_time() - cpu0, _proc_cpu_s(server_pid) - srv0, time.perf_counter() - wall0
    tokens = m.completion_tokens or 0
    return Row(sc, m.output_tok_s, cpu / wall, tokens / cpu if cpu > 0 else float("inf"), srv / wall)


async def _measure_sharded(url: str, sc: Scenario, server_pid: int, shard_cpus: list[int] | None) -> Row:
    prompt = f"burst={sc.burst} rate={sc.rate_per_stream} mode={sc.name}"
    async with ShardPool(sc.processes, base_url=url, prompts=[prompt], request_timeout_s=120.0) as pool:
        await pool.start()
        for i, pid in enumerate(pool.pids):
            if shard_cpus:
                os.sched_setaffinity(pid, {shard_cpus[i % len(shard_cpus)]})
        c, n = sc.concurrency, sc.output_len
        await pool.run_pass(count=c, concurrency=c, output_len=n, phase="warm-up")
        srv0, wall0 = _proc_cpu_s(server_pid), time.perf_counter()
        sharded = await pool.run_pass(count=sc.num_prompts, concurrency=c, output_len=n, phase="measured")
        srv, wall = _proc_cpu_s(server_pid) - srv0, time.perf_counter() - wall0
    tokens = sum(r.completion_tokens for r in sharded.result.requests)
    busiest = max(sharded.cpu_s)
    return Row(
        sc,
        sharded.result.output_tok_s,
        busiest / sharded.result.wall_s,
        tokens / busiest if busiest > 0 else float("inf"),
        srv / wall,
    )


def _sharded_scenarios(quick: bool, practical: float, processes: int) -> list[Scenario]:
    n = 2 if quick else 4
    out = []
    for mode in ("stepped", "paced"):
        for burst in (1, 3):
            out.append(Scenario(mode, 64, burst, 256, 64 * n // 2, practical / 64, processes=processes))
    return out


def _scenarios(quick: bool, practical: float) -> list[Scenario]:
    n = 2 if quick else 4  # passes worth of prompts per stream
    out = [
        Scenario("flood", 1, 1, 256, 40 * n, 0),
        Scenario("flood", 16, 1, 256, 16 * n, 0),
        Scenario("flood", 64, 1, 256, 64 * n, 0),
        Scenario("flood", 64, 3, 256, 64 * n, 0),
        Scenario("flood", 64, 1, 1024, 64 * max(1, n // 2), 0),
    ]
    # At the practical peak: each of c streams at practical/c tok/s; "stepped" streams share one
    # step clock (every running request gets its tokens in the same decode step, as in an engine),
    # "paced" streams tick independently (more wake-ups: a pessimistic bound).
    for mode in ("stepped", "paced"):
        for burst in (1, 3):
            out.append(Scenario(mode, 64, burst, 256, 64 * n // 2, practical / 64))
        out.append(Scenario(mode, 16, 1, 256, 16 * n, practical / 16))
    out = out[:4] + out[5:7] + out[8:10] if quick else out
    # httpx's default transport on the worst cases, to show why run_workload does not use it.
    out.append(Scenario("flood", 64, 1, 256, 64 * n, 0, "httpx"))
    out.append(Scenario("paced", 64, 1, 256, 64 * n // 2, practical / 64, "httpx"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="fewer, shorter scenarios")
    ap.add_argument(
        "--practical-tok-s", type=float, default=5000.0, help="highest aggregate tok/s measured in practice [5000]"
    )
    ap.add_argument("--uvloop", action="store_true", help="run the load generator on uvloop (must be importable)")
    ap.add_argument(
        "--pin",
        metavar="GEN,SERVER",
        help="pin the generator and the server to these CPU numbers (e.g. 2,3) for a clean one-core figure",
    )
    ap.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="also run the stepped/paced scenarios sharded over N generator processes (as run_workload does)",
    )
    ap.add_argument("--shard-cpus", metavar="CPUS", help="pin the generator processes to these CPUs (e.g. 4,5,6,7)")
    args = ap.parse_args()
    shard_cpus = [int(x) for x in args.shard_cpus.split(",")] if args.shard_cpus else None
    pins = [int(x) for x in args.pin.split(",")] if args.pin else None
    if pins is not None and len(pins) != 2:
        ap.error("--pin takes two CPU numbers: GEN,SERVER")
    loop_factory = None
    if args.uvloop:
        import uvloop

        loop_factory = uvloop.new_event_loop
    if args.serve:
        asyncio.run(_serve())
        return 0
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if pins is not None:
            os.sched_setaffinity(0, {pins[0]})
            os.sched_setaffinity(server.pid, {pins[1]})
        assert server.stdout is not None
        port = int(server.stdout.readline())
        url = f"http://127.0.0.1:{port}"
        rows = []
        loop_name = "uvloop" if args.uvloop else "asyncio"
        print(
            f"load generator capacity ({loop_name} event loops, one core each); practical peak {args.practical_tok_s:,.0f} tok/s"
        )
        header = (
            f"{'scenario':8} {'transport':9} {'conc':>4} {'tok/ev':>6} {'out_len':>7} {'tok/s':>9} "
            f"{'gen CPU':>7} {'capacity tok/s':>14} {'x practical':>11} {'server CPU':>10}"
        )
        print(header)
        print("-" * len(header))
        scenarios = _scenarios(args.quick, args.practical_tok_s)
        if args.processes > 1:
            scenarios += _sharded_scenarios(args.quick, args.practical_tok_s, args.processes)
        for sc in scenarios:
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                if sc.processes > 1:
                    row = runner.run(_measure_sharded(url, sc, server.pid, shard_cpus))
                else:
                    row = runner.run(_measure(url, sc, server.pid))
            rows.append(row)
            print(
                f"{sc.name:8} {sc.client:9} {sc.concurrency:>4} {sc.burst:>6} {sc.output_len:>7} {row.tok_s:>9,.0f} "
                f"{row.cpu_share:>7.0%} {row.capacity_tok_s:>14,.0f} {row.capacity_tok_s / args.practical_tok_s:>10.1f}x "
                f"{row.server_cpu_share:>10.0%}",
                flush=True,
            )
        ok = True
        for procs in sorted({sc.processes for sc in scenarios}):
            fast = [r for r in rows if r.scenario.transport == "fast" and r.scenario.processes == procs]
            worst = min(fast, key=lambda r: r.capacity_tok_s)
            margin = worst.capacity_tok_s / args.practical_tok_s
            verdict = "OK" if margin >= 10 else "BELOW the 10x target"
            what = "one event loop" if procs == 1 else f"{procs} generator processes"
            print(
                f"\nworst case, {what}: {worst.scenario.name} c={worst.scenario.concurrency} "
                f"burst={worst.scenario.burst}: {worst.capacity_tok_s:,.0f} tok/s = {margin:.1f}x the practical peak "
                f"-> {verdict}"
            )
            ok = margin >= 10  # the verdict that counts: the largest configuration measured
        return 0 if ok else 1
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)


if __name__ == "__main__":
    sys.exit(main())
