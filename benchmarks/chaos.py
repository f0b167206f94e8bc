"""Chaos run: a study survives killed workers, a killed API process and a Postgres restart.

    python -m benchmarks.chaos                      # 2 APIs, 12 workers, 60 trials, Postgres restart
    python -m benchmarks.chaos --workers 4 --trials 12 --worker-kills 3 --no-postgres-restart

Two `spectune server` processes (separate engines) share one Postgres database; workers (real
`spectune worker` processes driving the simulated engine) are split between the two URLs.  While
the study runs, a seeded schedule (points of the study's progress) SIGKILLs random workers and restarts them after a moment (as
systemd does: KillMode=mixed takes the engine down with the worker), SIGKILLs one API process
and starts it again on the same port, and (optionally) restarts Postgres once.  At the end every
process is stopped the way systemd stops it (SIGTERM) and the run is checked against what
spectune promises, each check printed as a figure:

* every trial of the study ended exactly once: COMPLETE, or FAIL with a reason; none left running;
* every report a worker queued (its log and outbox) is in the leases table, or was refused
  because the API had already settled that lease (counted separately, with the reason);
* no lease was held by two workers at once: per trial and per worker, the active intervals of
  leases (from leased_at to the first of expiry and report) never overlap;
* no orphaned engine: no server process any worker started is alive after the workers stopped;
* reclaimed leases: how long after its deadline a lease was reclaimed, and how long until its
  trial was leased again;
* no token value in any API or worker log.

Everything runs on 127.0.0.1; every wait has a deadline.  `tests/benchmarks/test_chaos.py` runs a small
version in CI.  Results of the full run: benchmarks/README.md, "Chaos run".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from optimizer.attrs import records
from tests.support.cluster import WorkerProc, group_alive, kill_engines, start_worker, write_worker_config
from tests.support.helpers import free_port, spawn_api
from workers.lifeline import child_env

MODELS = {"moe-pcie": "moe-pcie", "moe-pcie-eagle3": "moe-pcie-eagle3"}
STUDY = "chaos"
# Worker log lines the checks read (workers/agent.py, workers/outbox.py).
QUEUED_RE = re.compile(r"lease (\S+): report \((\w+)(?: \((\w+)\))?\) queued")
SENT_DIRECTLY_RE = re.compile(r"lease (\S+): report \((.+?)\) sent")
DELIVERED_RE = re.compile(r"report for lease (\S+) delivered")
DROPPED_RE = re.compile(r"dropping the (\w+) report for lease (\S+), queued .*?: (.*)$", re.M)
REJECTED_RE = re.compile(r"REJECTED the report for lease (\S+)")


@dataclass(frozen=True)
class ChaosPlan:
    workers: int = 12
    trials: int = 60
    worker_kills: int = 12
    kill_api: bool = True
    restart_postgres: bool = True
    seed: int = 7
    lease_ttl_s: float = 5.0
    max_attempts: int = 5
    # Worker kills fire at random points of the study's progress (fractions of the trials
    # finished), so every planned kill happens however fast or slow the machine is.
    kill_window: tuple[float, float] = (0.05, 0.85)
    # A killed worker stays down for this many lease TTLs (uniform): under 1 it comes back and
    # gets its own live lease again; over 1 its lease expires and another worker takes the trial.
    down_ttls: tuple[float, float] = (0.1, 2.5)
    time_limit_s: float = 900.0
    # API processes on the database (two exercise cross-process coordination; SQLite gets one).
    apis: int = 2
    # CPU-bound processes started next to the run (two per core is the stress test's contention).
    busy_loops: int = 0
    confirm_top: int = 3


def study_spec(trials: int, seed: int, confirm_top: int = 3) -> dict[str, Any]:
    return {
        "name": STUDY,
        "model": {"target": "moe-pcie", "draft": "moe-pcie-eagle3"},
        "search_space": {"num_steps": {"low": 1, "high": 8}, "topk": [1, 2, 4, 8], "num_draft_tokens": {"low": 2, "high": 32}},
        # Long enough that kills land mid-benchmark, short enough for a bounded run.
        "workload": {"output_len": 48, "num_prompts": 4, "concurrency": [1, 2], "warmup_requests": 1, "repeats": 2},
        "budget": {"max_trials": trials},
        "sampler": "random",
        "seed": seed,
        "confirmation": {"top": confirm_top},
    }  # fmt: skip


# ------------------------------------------------------------------------------------ processes


@dataclass
class ApiProc:
    """One `spectune server` process on a fixed port, killable and restartable."""

    name: str
    db_url: str
    log: Path
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    workers: int = 1  # `spectune server --workers`

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        self.proc = spawn_api(
            self.db_url, log_path=self.log, env=self.env, port=self.port, timeout=timeout_s, workers=self.workers
        )

    def signal(self, sig: signal.Signals, wait_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(wait_s)


def kill_worker(w: WorkerProc) -> None:
    """SIGKILL the worker, then its engines, as systemd's KillMode=mixed does when the main process dies."""
    if w.proc is not None and w.proc.poll() is None:
        w.proc.kill()
        w.proc.wait(20)
    kill_engines(w)


def stop_worker(w: WorkerProc, timeout_s: float = 60.0) -> None:
    """`systemctl stop`: SIGTERM to the worker only; it stops its engine, reports and exits."""
    if w.proc is None or w.proc.poll() is not None:
        return
    w.proc.send_signal(signal.SIGTERM)
    try:
        w.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        w.proc.kill()
        w.proc.wait(20)


# ------------------------------------------------------------------------------------ database


@contextmanager
def session(db_url: str) -> Iterator[Any]:
    from api.db import make_engine, make_sessionmaker

    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as s:
            yield s
    finally:
        engine.dispose()


@dataclass
class Snapshot:
    state: str
    trial_leases_done: int
    # Exact at the moment of the query (one statement, one snapshot): workers holding two
    # active leases, and trials with two active leases.
    double_workers: list[str]
    double_trials: list[str]
    # Active trial leases whose Optuna trial is already finished.  A report makes that true for
    # the moment between Optuna's commit and ours; a lease seen so twice, apart, is a violation.
    active_on_finished: list[str] = field(default_factory=list)


def snapshot(db_url: str) -> Snapshot | None:
    """The study's state and the lease invariants now, or None while the database is unreachable."""
    from sqlalchemy import func, select, text
    from sqlalchemy.exc import SQLAlchemyError

    from api.models import LeaseRow, StudyRow

    try:
        with session(db_url) as s:
            row = s.get(StudyRow, STUDY)
            done = s.scalar(
                select(func.count())
                .select_from(LeaseRow)
                .where(
                    LeaseRow.study_name == STUDY, LeaseRow.kind == "trial", LeaseRow.state.in_(("completed", "failed"))
                )
            )
            workers = s.execute(
                text(
                    "SELECT worker_id FROM spectune_leases WHERE state = 'active' "
                    "GROUP BY worker_id HAVING COUNT(*) > 1"
                )
            ).scalars()
            trials = s.execute(
                text(
                    "SELECT kind || ' ' || trial_number FROM spectune_leases WHERE state = 'active' "
                    "AND trial_number IS NOT NULL GROUP BY study_name, kind, trial_number HAVING COUNT(*) > 1"
                )
            ).scalars()
            stale = s.execute(
                text(
                    "SELECT l.id FROM spectune_leases l JOIN studies st ON st.study_name = l.study_name "
                    "JOIN trials t ON t.study_id = st.study_id AND t.number = l.trial_number "
                    "WHERE l.state = 'active' AND l.kind = 'trial' AND t.state <> 'RUNNING'"
                )
            ).scalars()
            return Snapshot(row.state if row else "missing", int(done or 0), list(workers), list(trials), list(stale))
    except SQLAlchemyError:
        return None


def restart_postgres() -> float:
    """Restart the local cluster (Debian's pg_ctlcluster); returns seconds it took."""
    versions = sorted(os.listdir("/etc/postgresql"))
    start = time.monotonic()
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "restart"], check=True, timeout=120
    )
    return time.monotonic() - start


# ------------------------------------------------------------------------------------ the run


@dataclass
class ChaosLog:
    events: list[str] = field(default_factory=list)
    worker_kills: int = 0
    api_kills: int = 0
    postgres_restarts: int = 0
    postgres_restart_s: float = 0.0
    wall_s: float = 0.0
    finished: bool = False
    snapshots: int = 0
    double_holds: list[str] = field(default_factory=list)
    # lease id -> when it was first seen active on a finished trial; and the confirmed violations.
    active_on_finished_since: dict[str, float] = field(default_factory=dict)
    stale_leases: list[str] = field(default_factory=list)

    def note(self, t0: float, what: str) -> None:
        line = f"{time.monotonic() - t0:7.1f} s  {what}"
        self.events.append(line)
        print(line, flush=True)


@dataclass
class Cluster:
    root: Path
    db_url: str
    apis: list[ApiProc]
    workers: list[WorkerProc]
    tokens: dict[str, str]


def start_cluster(plan: ChaosPlan, root: Path, db_url: str) -> Cluster:
    from api.auth import create_token
    from api.db import make_engine, make_sessionmaker

    env = {
        "SPECTUNE_HEARTBEAT_INTERVAL_S": "1",
        "SPECTUNE_LEASE_TTL_S": str(plan.lease_ttl_s),
        "SPECTUNE_MAX_ATTEMPTS": str(plan.max_attempts),
        # Chaos kills many workers: a worker must not be quarantined for being killed.
        "SPECTUNE_QUARANTINE_AFTER": "1000",
        # No estimate at creation: its rehearsals are not what chaos tests.
        "SPECTUNE_ESTIMATE_DRAWS": "0",
        # Artifacts and the session secret stay in the run's folder, never the checkout.
        "SPECTUNE_ARTIFACT_DIR": str(root / "artifacts"),
    }
    apis = [ApiProc(n, db_url, root / f"api-{n}.log", env) for n in ("a", "b")[: plan.apis]]
    engine = make_engine(db_url)
    tokens: dict[str, str] = {}
    try:
        factory = make_sessionmaker(engine)
        tokens["user"] = create_token(factory, "user", "chaos-user")[1]
        for i in range(plan.workers):
            name = f"gpu-{i:02d}"
            # Least privilege: each worker's token can act only as that worker.
            tokens[name] = create_token(factory, "worker", name, worker_id=name)[1]
    finally:
        engine.dispose()
    for api in apis:
        api.start()
    r = httpx.post(
        f"{apis[0].url}/v1/studies",
        json=study_spec(plan.trials, plan.seed, plan.confirm_top),
        headers={"Authorization": f"Bearer {tokens['user']}"},
        timeout=60,
    )
    if r.status_code != 201:
        raise RuntimeError(f"cannot create the study: {r.status_code} {r.text}")
    workers = []
    for i in range(plan.workers):
        name = f"gpu-{i:02d}"
        w = write_worker_config(root, name, apis[i % len(apis)].url, tokens[name], MODELS)
        start_worker(w)
        workers.append(w)
    return Cluster(root, db_url, apis, workers, tokens)


# An active lease on a finished trial for this long is a violation, not a report being recorded.
STALE_AFTER_S = 3.0


@contextmanager
def busy_loops(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`n` processes spinning on a core each, stopped (with their groups) on the way out."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], env=child_env(), start_new_session=True)
        for _ in range(n)
    ]
    try:
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def run_chaos(
    plan: ChaosPlan, root: Path, db_url: str, *, postgres_restart: Callable[[], float] | None = None
) -> ChaosReport:
    """Run the study under the plan's faults; stop everything; return the checked figures."""
    with busy_loops(plan.busy_loops):
        return _run_chaos(plan, root, db_url, postgres_restart)


def _run_chaos(plan: ChaosPlan, root: Path, db_url: str, postgres_restart: Callable[[], float] | None) -> ChaosReport:
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(plan.seed)
    log = ChaosLog()
    t0 = time.monotonic()
    cluster = start_cluster(plan, root, db_url)
    down: dict[str, float] = {}  # worker name -> when to restart it
    try:
        deadline = t0 + plan.time_limit_s
        kill_at = sorted(plan.trials * rng.uniform(*plan.kill_window) for _ in range(plan.worker_kills))
        api_killed = not plan.kill_api
        pg_restarted = not (plan.restart_postgres and postgres_restart is not None)
        last_progress = ""
        while time.monotonic() < deadline:
            now = time.monotonic()
            snap = snapshot(db_url)
            if snap is not None:
                log.snapshots += 1
                for holder in snap.double_workers + snap.double_trials:
                    log.double_holds.append(holder)
                    log.note(t0, f"TWO ACTIVE LEASES: {holder}")
                seen = log.active_on_finished_since
                for lease_id in list(seen):
                    if lease_id not in snap.active_on_finished:
                        del seen[lease_id]
                for lease_id in snap.active_on_finished:
                    first = seen.setdefault(lease_id, now)
                    if now - first >= STALE_AFTER_S and lease_id not in log.stale_leases:
                        log.stale_leases.append(lease_id)
                        log.note(t0, f"ACTIVE LEASE ON A FINISHED TRIAL: {lease_id}")
                progress = f"study {snap.state}, {snap.trial_leases_done} trial leases finished"
                if progress != last_progress:
                    log.note(t0, progress)
                    last_progress = progress
                if snap.state != "running":
                    log.finished = True
                    break
            done = 0 if snap is None else snap.trial_leases_done
            for w in cluster.workers:  # restart killed workers when their time comes
                if w.name in down and now >= down[w.name]:
                    del down[w.name]
                    start_worker(w)
                    log.note(t0, f"restarted worker {w.name}")
            if log.worker_kills < plan.worker_kills and done >= kill_at[log.worker_kills]:
                candidates = [w for w in cluster.workers if w.name not in down]
                w = rng.choice(candidates)
                kill_worker(w)
                down[w.name] = now + plan.lease_ttl_s * rng.uniform(*plan.down_ttls)
                log.worker_kills += 1
                log.note(t0, f"SIGKILL worker {w.name} (and its engines)")
            if not api_killed and done >= plan.trials // 4:
                api = cluster.apis[-1]
                api.signal(signal.SIGKILL)
                log.api_kills += 1
                log.note(t0, f"SIGKILL API {api.name}; restarting it in 3 s")
                time.sleep(3)
                api.start()
                log.note(t0, f"API {api.name} back on port {api.port}")
                api_killed = True
            if not pg_restarted and done >= plan.trials // 2 and postgres_restart is not None:
                log.note(t0, "restarting Postgres")
                log.postgres_restart_s = postgres_restart()
                log.postgres_restarts += 1
                log.note(t0, f"Postgres back after {log.postgres_restart_s:.1f} s")
                pg_restarted = True
            time.sleep(0.5)
        # As systemd would: a worker killed near the end comes back and delivers what its outbox
        # holds (the API keeps a late report, or answers that the lease was settled elsewhere).
        for w in cluster.workers:
            if w.name in down:
                del down[w.name]
                start_worker(w)
                log.note(t0, f"restarted worker {w.name} after the study ended")
        flush_deadline = time.monotonic() + 30
        while time.monotonic() < flush_deadline and any(
            w.outbox.exists() and any(w.outbox.glob("*.json")) for w in cluster.workers
        ):
            time.sleep(0.5)
        log.wall_s = time.monotonic() - t0
        log.note(t0, "stopping the workers (SIGTERM)")
    finally:
        for w in cluster.workers:
            stop_worker(w)
        orphans = sorted(pid for w in cluster.workers for pid in w.engine_pids() if group_alive(pid))
        for w in cluster.workers:
            kill_engines(w)  # clean up whatever a failed run left behind
        for api in cluster.apis:
            api.signal(signal.SIGTERM)
    return check(cluster, log, orphans, faults=plan.worker_kills > 0 or plan.kill_api)


# ------------------------------------------------------------------------------------ checks


@dataclass
class ChaosReport:
    log: ChaosLog
    figures: dict[str, Any]
    problems: list[str]

    def lines(self) -> list[str]:
        out = [f"{k}: {v}" for k, v in self.figures.items()]
        out.append("problems: " + ("none" if not self.problems else ""))
        out += [f"  - {p}" for p in self.problems]
        return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


LAUNCH_RE = re.compile(r"lease (\S+): launching the server")
# uvicorn's access log: `"POST /v1/... HTTP/1.1" 503 Service Unavailable`
SERVER_ERROR_RE = re.compile(r'HTTP/1\.1" (5\d\d) ')


def check(cluster: Cluster, log: ChaosLog, orphans: list[int], *, faults: bool = True) -> ChaosReport:
    import optuna
    from sqlalchemy import select

    from api.models import EventRow, LeaseRow

    problems: list[str] = []
    with session(cluster.db_url) as s:
        leases = list(s.scalars(select(LeaseRow).where(LeaseRow.study_name == STUDY)))
        expired_at = {
            e.lease_id: e.at for e in s.scalars(select(EventRow).where(EventRow.kind == "lease_expired")) if e.lease_id
        }
        s.expunge_all()
    by_id = {le.id: le for le in leases}

    # 1. Trials: each ended once: COMPLETE, PRUNED (the pruner stopped it), or FAIL with a reason.
    storage = optuna.storages.RDBStorage(cluster.db_url, skip_table_creation=True)
    try:
        trials = optuna.load_study(study_name=STUDY, storage=storage).get_trials(deepcopy=False)
    finally:
        storage.engine.dispose()
    states: dict[str, int] = defaultdict(int)
    for r in records(trials):
        states[r.state.name] += 1
        if r.state.name in ("RUNNING", "WAITING"):
            problems.append(f"trial {r.number} is still {r.state.name}")
        if r.state.name == "FAIL" and not (r.failure_kind and r.failure_message):
            problems.append(f"trial {r.number} FAILED without a failure kind and message: {r.trial.user_attrs}")
    fail_reasons: dict[str, int] = defaultdict(int)
    for r in records(trials):
        if r.state.name == "FAIL":
            reason = f"{r.failure_kind}: {r.failure_message}"
            fail_reasons[re.sub(r"\d+", "N", reason)[:80]] += 1
    measured_per_trial: dict[int, int] = defaultdict(int)
    for le in leases:
        if le.kind == "trial" and le.state == "completed" and le.trial_number is not None:
            measured_per_trial[le.trial_number] += 1
    measured_twice = sorted(n for n, k in measured_per_trial.items() if k > 1)
    if measured_twice and not faults:
        problems.append(f"trials measured by two leases without any fault: {measured_twice}")

    # 2. Every report a worker queued is in the database (or was refused with a reason).
    queued: dict[str, str] = {}
    refused: dict[str, str] = {}
    tokens_in_logs = 0
    secrets = list(cluster.tokens.values())
    for w in cluster.workers:
        text = w.log_text()
        for m in QUEUED_RE.finditer(text):
            queued[m.group(1)] = w.name
        for m in SENT_DIRECTLY_RE.finditer(text):
            queued[m.group(1)] = w.name
        for m in DROPPED_RE.finditer(text):
            refused[m.group(2)] = m.group(3).strip()
        for m in REJECTED_RE.finditer(text):
            refused[m.group(1)] = "rejected"
        tokens_in_logs += sum(text.count(t) for t in secrets)
        left = list(w.outbox.glob("*.json")) if w.outbox.exists() else []
        if left:
            problems.append(f"worker {w.name}: {len(left)} report(s) still in its outbox: {[p.name for p in left]}")
    launches: dict[str, int] = defaultdict(int)
    for w in cluster.workers:
        for m in LAUNCH_RE.finditer(w.log_text()):
            launches[m.group(1)] += 1
    # A worker killed mid-work may start its live lease once more after its restart; never more.
    most = 2 if faults else 1
    for lease_id, n in sorted(launches.items()):
        if n > most:
            problems.append(f"lease {lease_id} launched {n} times")
    server_errors: dict[str, int] = defaultdict(int)
    for api in cluster.apis:
        text = api.log.read_text(errors="replace")
        tokens_in_logs += sum(text.count(t) for t in secrets)
        for m in SERVER_ERROR_RE.finditer(text):
            server_errors[m.group(1)] += 1
        if "Traceback" in text:
            problems.append(f"a traceback in API {api.name}'s log ({api.log})")
    if server_errors and not faults:
        problems.append(f"server errors answered: {dict(server_errors)}")
    if tokens_in_logs:
        problems.append(f"{tokens_in_logs} token value(s) found in the API and worker logs")
    kept = 0
    refused_settled = 0
    for lease_id, worker in sorted(queued.items()):
        row = by_id.get(lease_id)
        if row is not None and row.result is not None and row.state in ("completed", "failed"):
            kept += 1
        elif lease_id in refused and row is not None and row.state in ("superseded", "expired", "completed", "failed"):
            refused_settled += 1
        else:
            state = "missing" if row is None else row.state
            problems.append(f"report of lease {lease_id} (worker {worker}) is not in the database (lease {state})")

    # 3. No lease held by two workers at once.  Sampled during the run from the database, where
    # each query sees one consistent snapshot.  Lease timestamps cannot show it afterwards: they
    # are Postgres now(), the start of the writing transaction, which can be seconds before the
    # write when it waited for the study lock (see "Chaos run" in benchmarks/README.md).
    for holder in sorted(set(log.double_holds)):
        problems.append(f"two active leases at once: {holder}")
    for lease_id in log.stale_leases:
        problems.append(f"lease {lease_id} stayed active for {STALE_AFTER_S:.0f} s after its trial finished")

    # 4. Orphaned engines.
    if orphans:
        problems.append(f"engine process groups alive after every worker stopped: {orphans}")

    # 5. Reclaimed leases: deadline -> reclaim, reclaim -> next lease of the same trial.
    reclaim_lag: list[float] = []
    relase_lag: list[float] = []
    for le in leases:
        at = expired_at.get(le.id)
        if at is None:
            continue
        if le.deadline is not None:
            reclaim_lag.append((at - le.deadline).total_seconds())
        if le.trial_number is None:
            continue
        nxt = [
            o.leased_at
            for o in leases
            if o.trial_number == le.trial_number and o.kind == le.kind and o.attempt == le.attempt + 1 and o.leased_at
        ]
        if nxt:
            relase_lag.append((min(nxt) - at).total_seconds())

    lease_states: dict[str, int] = defaultdict(int)
    for le in leases:
        lease_states[f"{le.kind}/{le.state}"] += 1
    if not log.finished:
        problems.append(f"the study did not finish within the time limit ({log.wall_s:.0f} s)")
    figures: dict[str, Any] = {
        "wall time": f"{log.wall_s:.0f} s",
        "faults": (
            f"{log.worker_kills} worker SIGKILLs, {log.api_kills} API SIGKILL, "
            f"{log.postgres_restarts} Postgres restart ({log.postgres_restart_s:.1f} s)"
        ),
        "trials": dict(sorted(states.items())),
        "FAIL reasons": dict(fail_reasons),
        "trials measured by two leases (late report kept, both stored)": len(measured_twice),
        "leases by kind/state": dict(sorted(lease_states.items())),
        "reports queued by workers": len(queued),
        "  in the database": kept,
        "  refused, lease already settled by the API": refused_settled,
        "  lost": len(queued) - kept - refused_settled,
        "two active leases for one worker or one trial": f"{len(log.double_holds)} in {log.snapshots} snapshots",
        "active leases on finished trials (past the report window)": len(log.stale_leases),
        "launches, most for one lease": f"{sum(launches.values())}, {max(launches.values(), default=0)}",
        "5xx answered by the API": dict(server_errors),
        "orphaned engines": len(orphans),
        "leases reclaimed": len(reclaim_lag),
        "  reclaimed after deadline, p50 / max": f"{_pct(reclaim_lag, 0.5):.1f} / {max(reclaim_lag, default=float('nan')):.1f} s",
        "  trial leased again after reclaim, p50 / max": (
            f"{_pct(relase_lag, 0.5):.1f} / {max(relase_lag, default=float('nan')):.1f} s"
        ),
        "token values in logs": tokens_in_logs,
    }
    if refused:
        figures["refusal reasons"] = sorted(set(refused.values()))[:5]
    return ChaosReport(log, figures, problems)


# ------------------------------------------------------------------------------------ main


def create_database(admin_dsn: str) -> tuple[str, Callable[[], None]]:
    """A fresh database on the Postgres server of `admin_dsn`, at schema head; and its drop()."""
    import psycopg

    from api.schema import upgrade

    name = f"spectune_chaos_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=5) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    host = re.search(r"host=(\S+)", admin_dsn)
    user = re.search(r"user=(\S+)", admin_dsn)
    url = f"postgresql+psycopg://{user.group(1) if user else 'postgres'}@{host.group(1) if host else '127.0.0.1'}:5432/{name}"
    upgrade(url)

    def drop() -> None:
        with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=5) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return url, drop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--trials", type=int, default=60)
    p.add_argument("--worker-kills", type=int, default=12)
    p.add_argument("--no-api-kill", action="store_true")
    p.add_argument("--no-postgres-restart", action="store_true")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--time-limit-s", type=float, default=900.0)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/spectune-chaos"))
    p.add_argument("--pg-admin-dsn", default="host=127.0.0.1 port=5432 user=postgres dbname=postgres")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    os.environ["TZ"] = "UTC"
    time.tzset()
    plan = ChaosPlan(
        workers=args.workers,
        trials=args.trials,
        worker_kills=args.worker_kills,
        kill_api=not args.no_api_kill,
        restart_postgres=not args.no_postgres_restart,
        seed=args.seed,
        time_limit_s=args.time_limit_s,
    )
    db_url, drop = create_database(args.pg_admin_dsn)
    root = args.workdir / time.strftime("%Y%m%d-%H%M%S")
    print(f"chaos run: {plan}\ndatabase {db_url}, files under {root}", flush=True)
    try:
        report = run_chaos(plan, root, db_url, postgres_restart=restart_postgres if plan.restart_postgres else None)
    finally:
        try:
            drop()
        except Exception as e:  # noqa: BLE001 - cleanup must not hide the result
            print(f"could not drop the chaos database: {e}", file=sys.stderr)
    print("\n".join(report.lines()))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"plan": str(plan), "figures": report.figures, "problems": report.problems}, indent=2, default=str
            )
        )
    return 0 if not report.problems else 1


if __name__ == "__main__":
    sys.exit(main())
