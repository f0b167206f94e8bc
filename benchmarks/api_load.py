"""API load: lease-protocol latency under 64 concurrent workers, and ask latency at 1,000 trials.

    python -m benchmarks.api_load                       # the figures in benchmarks/README.md
    python -m benchmarks.api_load --workers 16 --rounds 2 --fill 200   # a quick look
    python -m benchmarks.api_load --many-studies 300 --clients 40       # issue 18: many studies

One `spectune server` process (uvicorn, one event loop) on a fresh Postgres database on
127.0.0.1.  The workers are protocol-only: plain httpx coroutines with their own bound worker
tokens, no engine, reporting synthetic measurements, so the figures are the API's and the
database's alone.

Phase 1, protocol latency: every worker measures its baseline (lease + complete), then runs
`--rounds` trials: lease, two heartbeats, one progress, complete.  Latency per call, p50/p99.

Phase 2, ask latency: a second study (default sampler TPE) is filled to `--fill` finished trials
by `--fill-workers` concurrent workers (lease + complete), recording how the lease latency (which
includes Optuna's ask under the study lock) grows with the number of finished trials; then one
worker takes `--probe` more leases at that size, and the user-facing reads (show, trials) are
timed too.  Every loop is bounded by a count and by `--time-limit-s`.

`--many-studies N` runs a third scenario instead (issue 18, "responsive under load"): N running
studies, created by N/20 user tokens (the default per-user limit is 20 running studies), then
`--clients` concurrent clients for `--duration-s`: a third are readers (`GET /v1/studies`, then
one study's page, then `--think-s`), a tenth are probes (`GET /healthz` ten times a second, each
in a process of its own, as a load balancer is), the rest protocol-only workers (lease,
`--think-s` for the launch, heartbeat, `--think-s`, complete: a real trial takes minutes).  It
reports p50/p95/p99 per call and checks the issue's targets: `/healthz` p99 <= 100 ms,
`GET /v1/studies` p95 <= 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.chaos import ApiProc, create_database

MODELS = ["moe-pcie", "moe-pcie-eagle3"]
INVENTORY = {"hostname": "load", "sglang_version": "0.5.23", "models": MODELS, "labels": {}}
# A space with tens of thousands of distinct configurations, so 1,000 trials are 1,000 launches.
SPACE = {
    "num_steps": {"low": 1, "high": 16},
    "topk": [1, 2, 4, 8, 16],
    "num_draft_tokens": {"low": 2, "high": 128},
    "cuda_graph_max_bs": [16, 32, 64, 128],
}


def spec(name: str, max_trials: int, sampler: str) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"target": MODELS[0], "draft": MODELS[1]},
        "search_space": SPACE,
        "workload": {"output_len": 64, "num_prompts": 8, "concurrency": [1], "repeats": 1, "warmup_requests": 0},
        "budget": {"max_trials": max_trials},
        "sampler": sampler,
        "seed": 1,
    }


def ok_report(rng: random.Random) -> dict[str, Any]:
    tok_s = 90.0 * rng.uniform(0.7, 1.3)
    return {"outcome": "ok", "metrics": {"levels": [{"concurrency": 1, "output_tok_s": tok_s}], "startup_s": 1.0}}


@dataclass
class Timings:
    samples: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    async def timed(self, op: str, coro: Any) -> httpx.Response | None:
        """The response, or None when the call failed (time-out, refused); both are counted."""
        start = time.perf_counter()
        try:
            r: httpx.Response = await coro
        except httpx.HTTPError as e:
            self.samples[op].append(time.perf_counter() - start)
            self.errors[f"{op} {type(e).__name__}"] += 1
            return None
        self.samples[op].append(time.perf_counter() - start)
        if r.status_code >= 400:
            self.errors[f"{op} {r.status_code}"] += 1
        return r

    def table(self) -> list[str]:
        out = ["| call | n | p50 ms | p99 ms | max ms |", "|---|---:|---:|---:|---:|"]
        for op, xs in sorted(self.samples.items()):
            out.append(
                f"| {op} | {len(xs)} | {pct(xs, 0.5) * 1e3:.1f} | {pct(xs, 0.99) * 1e3:.1f} | {max(xs) * 1e3:.1f} |"
            )
        return out


def table95(t: Timings) -> list[str]:
    out = ["| call | n | p50 ms | p95 ms | p99 ms | max ms |", "|---|---:|---:|---:|---:|---:|"]
    for op, xs in sorted(t.samples.items()):
        ms = [pct(xs, q) * 1e3 for q in (0.5, 0.95, 0.99)]
        out.append(f"| {op} | {len(xs)} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[2]:.1f} | {max(xs) * 1e3:.1f} |")
    return out


def pct(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Worker:
    def __init__(self, client: httpx.AsyncClient, name: str, token: str, timings: Timings, seed: int) -> None:
        self.client, self.name, self.timings = client, name, timings
        self.headers = {"Authorization": f"Bearer {token}"}
        self.rng = random.Random(seed)

    async def lease(self, op: str = "lease") -> dict[str, Any] | None:
        r = await self.timings.timed(
            op, self.client.post(f"/v1/workers/{self.name}/lease", json=INVENTORY, headers=self.headers)
        )
        return dict(r.json()) if r is not None and r.status_code == 200 else None

    async def call(self, op: str, lease_id: str, body: Any = None) -> httpx.Response | None:
        return await self.timings.timed(
            op, self.client.post(f"/v1/leases/{lease_id}/{op}", json=body, headers=self.headers)
        )

    async def protocol_rounds(self, rounds: int, deadline: float) -> None:
        done = 0
        while done <= rounds and time.monotonic() < deadline:
            lease = await self.lease()
            if lease is None:
                if time.monotonic() < deadline and self.timings.errors:
                    await asyncio.sleep(0.5)  # an error (503, time-out): ask again, as a worker does
                    done += 1
                    continue
                return
            lid = lease["lease_id"]
            if lease["kind"] == "trial":
                for _ in range(2):
                    await self.call("heartbeat", lid)
                await self.call("progress", lid, {"step": 0, "concurrency": 1, "output_tok_s": 95.0})
            await self.call("complete", lid, ok_report(self.rng))
            done += 1

    async def fill(self, target: int, finished: list[int], curve: list[tuple[int, float]], deadline: float) -> None:
        while finished[0] < target and time.monotonic() < deadline:
            start = time.perf_counter()
            lease = await self.lease("lease (fill)")
            elapsed = time.perf_counter() - start
            if lease is None:
                await asyncio.sleep(0.05)
                continue
            if lease["kind"] == "trial":
                curve.append((finished[0], elapsed))
            await self.call("complete", lease["lease_id"], ok_report(self.rng))
            if lease["kind"] == "trial":
                finished[0] += 1


def make_tokens(db_url: str, n: int) -> tuple[str, list[str]]:
    from api.auth import create_token
    from api.db import make_engine, make_sessionmaker

    engine = make_engine(db_url)
    try:
        factory = make_sessionmaker(engine)
        user = create_token(factory, "user", "load-user")[1]
        workers = [create_token(factory, "worker", f"w{i:03d}", worker_id=f"w{i:03d}")[1] for i in range(n)]
        return user, workers
    finally:
        engine.dispose()


async def run(args: argparse.Namespace, url: str, user: str, tokens: list[str]) -> dict[str, Any]:
    deadline = time.monotonic() + args.time_limit_s
    uh = {"Authorization": f"Bearer {user}"}
    limits = httpx.Limits(max_connections=args.workers + 8, max_keepalive_connections=args.workers + 8)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout_s, limits=limits) as client:
        # Phase 1: the protocol under 64 concurrent workers.
        r = await client.post("/v1/studies", json=spec("load", args.workers * (args.rounds + 1), "random"), headers=uh)
        assert r.status_code == 201, r.text
        proto = Timings()
        workers = [Worker(client, f"w{i:03d}", tokens[i], proto, i) for i in range(args.workers)]
        t = time.monotonic()
        await asyncio.gather(*(w.protocol_rounds(args.rounds, deadline) for w in workers))
        proto_wall = time.monotonic() - t
        calls = sum(len(x) for x in proto.samples.values())
        await client.post("/v1/studies/load/stop", headers=uh)

        # Phase 2: ask latency as the study grows to --fill finished trials.
        r = await client.post("/v1/studies", json=spec("ask", args.fill + args.probe + 10, args.sampler), headers=uh)
        assert r.status_code == 201, r.text
        fill_t = Timings()
        finished = [0]
        curve: list[tuple[int, float]] = []
        fillers = [Worker(client, f"w{i:03d}", tokens[i], fill_t, 1000 + i) for i in range(args.fill_workers)]
        t = time.monotonic()
        await asyncio.gather(*(w.fill(args.fill, finished, curve, deadline) for w in fillers))
        fill_wall = time.monotonic() - t
        probe_t = Timings()
        prober = Worker(client, "w000", tokens[0], probe_t, 7)
        for _ in range(args.probe):
            if time.monotonic() > deadline:
                break
            lease = await prober.lease("lease = ask (1 worker)")
            if lease is not None:
                await prober.call("complete", lease["lease_id"], ok_report(prober.rng))
        for _ in range(5):
            await probe_t.timed("GET /v1/studies/ask", client.get("/v1/studies/ask", headers=uh))
            await probe_t.timed("GET /v1/studies/ask/trials", client.get("/v1/studies/ask/trials", headers=uh))
    buckets: dict[int, list[float]] = defaultdict(list)
    for n, s in curve:
        buckets[(n // 100) * 100].append(s)
    return {
        "protocol": {"wall_s": proto_wall, "calls": calls, "calls_per_s": calls / proto_wall, "table": proto.table(),
                     "errors": dict(proto.errors)},
        "fill": {"finished": finished[0], "wall_s": fill_wall, "errors": dict(fill_t.errors),
                 "curve": [(k, len(v), pct(v, 0.5) * 1e3, pct(v, 0.99) * 1e3) for k, v in sorted(buckets.items())]},
        "probe": {"table": probe_t.table(), "errors": dict(probe_t.errors)},
    }  # fmt: skip


STUDIES_PER_USER = 20  # api.settings: max_running_studies_per_user's default


async def run_many(args: argparse.Namespace, url: str, users: list[str], tokens: list[str]) -> dict[str, Any]:
    """Issue 18's scenario: many running studies, readers, probes and workers at once."""
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout_s, limits=limits) as client:
        names = [f"many-{i:04d}" for i in range(args.many_studies)]
        made = asyncio.Semaphore(8)

        async def create(i: int, name: str) -> None:
            headers = {"Authorization": f"Bearer {users[i // STUDIES_PER_USER]}"}
            async with made:
                r = await client.post("/v1/studies", json=spec(name, 50, "random"), headers=headers)
            assert r.status_code == 201, r.text

        t = time.monotonic()
        await asyncio.gather(*(create(i, n) for i, n in enumerate(names)))
        created_s = time.monotonic() - t
        # The same probe on the idle server first: what this machine gives without the load.
        timings = Timings()
        for _ in range(50):
            await timings.timed("GET /healthz (idle)", client.get("/healthz"))
            await asyncio.sleep(0.02)
        deadline = time.monotonic() + args.duration_s
        uh = {"Authorization": f"Bearer {users[0]}"}
        n_probes = max(1, args.clients // 10)
        n_readers = max(1, args.clients // 3)
        n_workers = max(1, args.clients - n_probes - n_readers)
        rng = random.Random(1)

        async def start_probe() -> asyncio.subprocess.Process:
            # A process of its own, as a load balancer is: this one's event loop, busy with 36
            # other clients on the same machine, would add its own delays to the probe's.
            return await asyncio.create_subprocess_exec(
                sys.executable, "-m", "benchmarks.api_load", "--probe-url", url, "--duration-s", str(args.duration_s),
                stdout=asyncio.subprocess.PIPE, start_new_session=True,
            )  # fmt: skip

        async def probe(proc: asyncio.subprocess.Process) -> None:
            out, _ = await asyncio.wait_for(proc.communicate(), args.duration_s + 60)
            doc = json.loads(out)
            timings.samples["GET /healthz"].extend(doc["samples"])
            for what, n in doc["errors"].items():
                timings.errors[f"GET /healthz {what}"] += n

        async def reader() -> None:
            while time.monotonic() < deadline:
                await timings.timed("GET /v1/studies", client.get("/v1/studies", headers=uh))
                name = rng.choice(names)
                await timings.timed("GET /v1/studies/{name}", client.get(f"/v1/studies/{name}", headers=uh))
                await asyncio.sleep(args.think_s)

        async def worker(w: Worker) -> None:
            while time.monotonic() < deadline:
                lease = await w.lease()
                if lease is None:
                    await asyncio.sleep(0.5)
                    continue
                await asyncio.sleep(args.think_s)  # the launch and benchmark, shortened
                await w.call("heartbeat", lease["lease_id"])
                await asyncio.sleep(args.think_s)
                await w.call("complete", lease["lease_id"], ok_report(w.rng))

        workers = [Worker(client, f"w{i:03d}", tokens[i], timings, i) for i in range(n_workers)]
        probes: list[asyncio.subprocess.Process] = []
        try:
            for _ in range(n_probes):
                probes.append(await start_probe())
            # The readers and workers stand in for other machines; here they share the API's two
            # cores.  At a lower priority (the probes, started above, keep theirs) they take only
            # the CPU the API and Postgres leave: the figures are the server's, not this process's.
            # `--client-nice 0` gives the same-machine figure.
            if args.client_nice:
                os.nice(args.client_nice)
            t = time.monotonic()
            await asyncio.gather(
                *(probe(p) for p in probes),
                *(reader() for _ in range(n_readers)),
                *(worker(w) for w in workers),
            )
            wall = time.monotonic() - t
        finally:
            for proc in probes:  # every exit path: no probe outlives the run
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    return {
        "studies": args.many_studies, "created_s": created_s, "wall_s": wall,
        "clients": {"probes": n_probes, "readers": n_readers, "workers": n_workers, "nice": args.client_nice},
        "healthz_p99_ms": pct(timings.samples["GET /healthz"], 0.99) * 1e3,
        "list_p95_ms": pct(timings.samples["GET /v1/studies"], 0.95) * 1e3,
        "table": table95(timings), "errors": dict(timings.errors),
    }  # fmt: skip


def make_users(db_url: str, n: int) -> list[str]:
    from api.auth import create_token
    from api.db import make_engine, make_sessionmaker

    engine = make_engine(db_url)
    try:
        factory = make_sessionmaker(engine)
        return [create_token(factory, "user", f"load-user-{i:02d}")[1] for i in range(n)]
    finally:
        engine.dispose()


def main_many(args: argparse.Namespace) -> int:
    db_url, drop = create_database(args.pg_admin_dsn)
    log = Path(f"/tmp/spectune-api-load-{os.getpid()}.log")
    env = {"SPECTUNE_LEASE_TTL_S": "600", "SPECTUNE_HEARTBEAT_INTERVAL_S": "30"}
    api = ApiProc("load", db_url, log, env, workers=args.api_workers)
    try:
        _, tokens = make_tokens(db_url, args.clients)
        users = make_users(db_url, -(-args.many_studies // STUDIES_PER_USER))
        api.start()
        result = asyncio.run(run_many(args, api.url, users, tokens))
    finally:
        api.signal(__import__("signal").SIGTERM)
        drop()
    c = result["clients"]
    print(
        f"{result['studies']} running studies (created in {result['created_s']:.0f} s), {args.clients} clients "
        f"({c['probes']} probes, {c['readers']} readers, {c['workers']} workers at nice {c['nice']}) "
        f"for {result['wall_s']:.0f} s; {args.api_workers} API process(es)"
    )
    print("\n".join(result["table"]))
    print(f"errors: {result['errors'] or 'none'}")
    healthz_ok = result["healthz_p99_ms"] <= 100.0
    list_ok = result["list_p95_ms"] <= 1000.0
    print(f"/healthz p99 {result['healthz_p99_ms']:.1f} ms (target <= 100): {'met' if healthz_ok else 'MISSED'}")
    print(f"GET /v1/studies p95 {result['list_p95_ms']:.1f} ms (target <= 1000): {'met' if list_ok else 'MISSED'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if healthz_ok and list_ok else 1


def probe_main(url: str, duration_s: float) -> int:
    """`--probe-url`: GET /healthz ten times a second for `duration_s`; the latencies as JSON."""
    samples: list[float] = []
    errors: dict[str, int] = defaultdict(int)
    deadline = time.monotonic() + duration_s
    with httpx.Client(base_url=url, timeout=30) as client:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            try:
                r = client.get("/healthz")
                if r.status_code != 200:
                    errors[str(r.status_code)] += 1
            except httpx.HTTPError as e:
                errors[type(e).__name__] += 1
            samples.append(time.perf_counter() - start)
            time.sleep(0.1)
    print(json.dumps({"samples": samples, "errors": errors}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4, help="trials per worker in phase 1")
    p.add_argument("--fill", type=int, default=1000, help="finished trials in the phase-2 study")
    p.add_argument("--fill-workers", type=int, default=16)
    p.add_argument("--probe", type=int, default=30, help="leases timed at that size")
    p.add_argument("--sampler", default="tpe")
    p.add_argument("--time-limit-s", type=float, default=1200.0)
    p.add_argument("--timeout-s", type=float, default=60.0, help="client time-out of one call")
    p.add_argument("--pg-admin-dsn", default="host=127.0.0.1 port=5432 user=postgres dbname=postgres")
    p.add_argument("--json", type=Path)
    p.add_argument("--many-studies", type=int, default=0, help="run the many-studies scenario with this many")
    p.add_argument("--clients", type=int, default=40, help="concurrent clients of the many-studies scenario")
    p.add_argument("--duration-s", type=float, default=60.0, help="how long the many-studies clients run")
    p.add_argument(
        "--think-s", type=float, default=1.0,
        help="pause of a many-studies reader between visits, and of a worker between its calls (0: flat out)",
    )  # fmt: skip
    p.add_argument(
        "--client-nice", type=int, default=10,
        help="OS priority (nice) of the many-studies readers and workers, which stand in for other machines (0: same)",
    )  # fmt: skip
    p.add_argument(
        "--api-workers", type=int, default=1, help="`spectune server --workers` of the many-studies scenario"
    )
    p.add_argument("--probe-url", help=argparse.SUPPRESS)  # the many-studies scenario's probe processes
    args = p.parse_args(argv)
    os.environ["TZ"] = "UTC"
    time.tzset()
    if args.probe_url:
        return probe_main(args.probe_url, args.duration_s)
    if args.many_studies > 0:
        return main_many(args)
    db_url, drop = create_database(args.pg_admin_dsn)
    log = Path(f"/tmp/spectune-api-load-{os.getpid()}.log")
    api = ApiProc("load", db_url, log, {"SPECTUNE_LEASE_TTL_S": "600", "SPECTUNE_HEARTBEAT_INTERVAL_S": "30"})
    try:
        user, tokens = make_tokens(db_url, max(args.workers, args.fill_workers))
        api.start()
        result = asyncio.run(run(args, api.url, user, tokens))
    finally:
        api.signal(__import__("signal").SIGTERM)
        drop()
    pr, fl = result["protocol"], result["fill"]
    print(f"phase 1: {args.workers} workers, {pr['calls']} calls in {pr['wall_s']:.1f} s ({pr['calls_per_s']:.0f}/s)")
    print("\n".join(pr["table"]))
    print(f"errors: {pr['errors'] or 'none'}")
    print(f"\nphase 2: {fl['finished']} trials finished by {args.fill_workers} workers in {fl['wall_s']:.0f} s")
    print("| finished trials | leases | p50 ms | p99 ms |\n|---:|---:|---:|---:|")
    for k, n, p50, p99 in fl["curve"]:
        print(f"| {k}-{k + 99} | {n} | {p50:.0f} | {p99:.0f} |")
    print(f"errors: {fl['errors'] or 'none'}\n")
    print("\n".join(result["probe"]["table"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
