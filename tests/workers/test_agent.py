"""The worker agent's loop against a fake lease API served by uvicorn on 127.0.0.1.

The fake API speaks spectune_protocol/ (leases handed out from a script, the same lease returned
while it is live, idempotent complete) and records every call, so the tests assert what the
worker said to the API and in which order.  Tests that launch a server use the real launcher and
the simulated engine (`python -m spectune_sim`) and are skipped until it is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request, Response

from spectune_protocol import CompleteIn, Failure
from tests.support.helpers import free_port, sim_worker_toml, wait_for, write_token
from workers.agent import EXIT_CONFIG, Agent
from workers.client import make_http_client
from workers.config import load_config
from workers.main import build_agent
from workers.outbox import Outbox

TOKEN = "worker-token-abc"
HAVE_SIMULATOR = importlib.util.find_spec("spectune_sim.__main__") is not None
needs_simulator = pytest.mark.skipif(not HAVE_SIMULATOR, reason="spectune_sim not available yet")


@contextlib.contextmanager
def worker_process(config: Path) -> Iterator[tuple[subprocess.Popen[bytes], Callable[[], str]]]:
    """`python -m workers.main config` as a real process (real signals); its log goes to a file."""
    log_path = config.parent / "worker.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "workers.main", str(config)], stderr=log_file)
    try:
        yield proc, lambda: log_path.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def lease_body(lease_id: str, *, target: str = "llama", draft: str | None = "eagle", **over: Any) -> dict[str, Any]:
    spec = None if draft is None else {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}
    body: dict[str, Any] = {
        "lease_id": lease_id,
        "kind": "trial" if draft else "baseline",
        "study": "demo",
        "trial_number": 0 if draft else None,
        "attempt": 1,
        "deadline": "2026-11-29T12:00:00Z",
        "heartbeat_interval_s": 0.2,
        "server": {"target": target, "draft": draft, "max_running_requests": 8, "speculative": spec},
        "workload": {"concurrency": [1, 2], "num_prompts": 4, "output_len": 16, "warmup_requests": 1, "repeats": 1},
    }
    body.update(over)
    return body


@dataclass
class FakeApi:
    """Scripted lease API.  `calls` records (endpoint, lease or worker id, JSON body)."""

    queue: list[dict[str, Any]] = field(default_factory=list)
    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    held: dict[str, dict[str, Any]] = field(default_factory=dict)
    completed: dict[str, dict[str, Any]] = field(default_factory=dict)
    expired: set[str] = field(default_factory=set)
    heartbeat_status: dict[str, int] = field(default_factory=dict)
    progress_action: dict[str, str] = field(default_factory=dict)
    complete_status: int | None = None  # e.g. 503 for an outage of the complete endpoint
    # A broken API that hands the held lease back even after it ended (the loop of issue 11).
    hand_back_forever: bool = False
    # When set, progress calls wait (at most 60 s) until the event is set: a test acts meanwhile.
    progress_gate: threading.Event | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def names(self, endpoint: str) -> list[str]:
        with self.lock:
            return [who for e, who, _ in self.calls if e == endpoint]

    def reports(self) -> dict[str, CompleteIn]:
        with self.lock:
            return {k: CompleteIn.model_validate(v) for k, v in self.completed.items()}

    def app(self) -> FastAPI:
        app = FastAPI()

        def authorised(request: Request) -> bool:
            return request.headers.get("authorization") == f"Bearer {TOKEN}"

        @app.post("/v1/workers/{worker_id}/lease")
        async def lease(worker_id: str, request: Request) -> Response:
            if not authorised(request):
                return Response(status_code=401, content=b'{"detail":"bad token"}')
            body = await request.json()
            with self.lock:
                self.calls.append(("lease", worker_id, body))
                current = self.held.get(worker_id)
                ended = current is not None and (
                    current["lease_id"] in self.completed or current["lease_id"] in self.expired
                )
                if current is None or (ended and not self.hand_back_forever):
                    if not self.queue:
                        return Response(status_code=204)
                    current = self.held[worker_id] = self.queue.pop(0)
            return Response(content=_json(current), media_type="application/json")

        @app.post("/v1/leases/{lease_id}/heartbeat")
        async def heartbeat(lease_id: str, request: Request) -> Response:
            with self.lock:
                self.calls.append(("heartbeat", lease_id, None))
                status = self.heartbeat_status.get(lease_id, 200)
                if status in (409, 410):
                    self.expired.add(lease_id)  # as the real API: a lost lease is never handed back
            if status != 200:
                return Response(status_code=status, content=b'{"detail":"lease expired"}')
            return Response(content=b'{"deadline":"2026-11-29T12:05:00Z"}', media_type="application/json")

        @app.post("/v1/leases/{lease_id}/progress")
        async def progress(lease_id: str, request: Request) -> Response:
            body = await request.json()
            with self.lock:
                self.calls.append(("progress", lease_id, body))
            gate = self.progress_gate
            for _ in range(6000):
                if gate is None or gate.is_set():
                    break
                await asyncio.sleep(0.01)
            with self.lock:
                action = self.progress_action.get(lease_id, "continue")
            return Response(content=_json({"action": action}), media_type="application/json")

        @app.post("/v1/leases/{lease_id}/complete")
        async def complete(lease_id: str, request: Request) -> Response:
            body = await request.json()
            with self.lock:
                self.calls.append(("complete", lease_id, body))
                if self.complete_status is not None:
                    return Response(status_code=self.complete_status, content=b'{"detail":"scripted"}')
                duplicate = lease_id in self.completed
                self.completed.setdefault(lease_id, body)
            out = {"lease_id": lease_id, "state": "complete", "duplicate": duplicate}
            return Response(content=_json(out), media_type="application/json")

        return app


def _json(obj: Any) -> bytes:
    import json

    return json.dumps(obj).encode()


class ApiServer:
    """uvicorn in a thread; stop() and start() again on the same port simulate an API restart."""

    def __init__(self, api: FakeApi) -> None:
        self.api = api
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        config = uvicorn.Config(self.api.app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        wait_for("the fake API to start", lambda: self._server is not None and self._server.started, 20)

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(20)
            self._server = None


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, ApiServer]]:
    fake = FakeApi()
    server = ApiServer(fake)
    server.start()
    yield fake, server
    server.stop()


def write_config(tmp_path: Path, api_url: str, *, token: str = TOKEN, time_scale: float = 0.02) -> Path:
    """A worker config driving the simulator; `time_scale` shrinks its start-up (about 30 s real)."""
    write_token(tmp_path, token)
    # The simulator picks its landscape from the last component of the model path.
    for name in ("dense-8b-h100", "mem-tight", "eagle3-draft"):
        (tmp_path / "models" / name).mkdir(parents=True, exist_ok=True)
    (tmp_path / "prompts").mkdir(exist_ok=True)
    path = tmp_path / "worker.toml"
    path.write_text(
        sim_worker_toml(
            api_url=api_url,
            worker_id="w1",
            top={"prompt_dir": "prompts", "idle_poll_s": 0.05, "idle_poll_max_s": 0.2},
            engine_env={"SPECTUNE_SIM_TIME_SCALE": str(time_scale)},
            timeouts={"startup_s": 60, "stop_s": 10, "api_s": 5, "api_retry_max_s": 0.5},
            models={"llama": "models/dense-8b-h100", "small-gpu": "models/mem-tight", "eagle": "models/eagle3-draft"},
            labels={"rack": "r1"},
        )
    )
    return path


@contextlib.contextmanager
def running_agent(config: Path) -> Iterator[tuple[Agent, list[int]]]:
    """The agent of `config` looping in a thread; stopped (first stage) on exit."""
    cfg = load_config(config)
    stop = threading.Event()
    result: list[int] = []
    with make_http_client(cfg.api_url, timeout_s=cfg.timeouts.api_s) as http:
        agent = build_agent(cfg, stop_event=stop, http=http)
        thread = threading.Thread(target=lambda: result.append(agent.run()), daemon=True)
        thread.start()
        try:
            yield agent, result
        finally:
            agent.request_stop("test finished")
            thread.join(60)
            assert not thread.is_alive(), "the agent did not stop within 60 s"


# -- tests that need no engine ---------------------------------------------------------------


def test_lease_for_a_model_outside_the_registry_is_refused_as_a_study_fault(tmp_path, api, caplog):
    caplog.set_level(logging.INFO)
    fake, server = api
    fake.queue = [lease_body("L-1", target="not-here"), lease_body("L-2", draft="unknown-draft")]
    with running_agent(write_config(tmp_path, server.url)) as (agent, _):
        wait_for("two reports", lambda: len(fake.completed) == 2)
    reports = fake.reports()
    for lid, name in (("L-1", "not-here"), ("L-2", "unknown-draft")):
        failure = reports[lid].failure
        assert reports[lid].outcome == "failed" and failure is not None
        assert failure.kind == "refused" and failure.host_fault is False
        assert name in failure.message and "[models]" in failure.message
    # The inventory told the API what this host has.
    inventory = next(body for e, _, body in fake.calls if e == "lease")
    assert inventory["models"] == ["eagle", "llama", "small-gpu"] and inventory["labels"]["rack"] == "r1"
    assert inventory["sglang_version"] == "0.5.23" and fake.names("lease")[0] == "w1"
    assert len(Outbox(tmp_path / "outbox")) == 0
    assert "lease L-1" in caplog.text and TOKEN not in caplog.text


def test_unknown_prompt_file_is_refused_before_any_launch(tmp_path, api):
    fake, server = api
    body = lease_body("L-1")
    body["workload"]["prompts"] = "absent.jsonl"
    fake.queue = [body]
    with running_agent(write_config(tmp_path, server.url)):
        wait_for("the report", lambda: "L-1" in fake.completed)
    failure = fake.reports()["L-1"].failure
    assert failure is not None and failure.kind == "refused" and not failure.host_fault
    assert "absent.jsonl" in failure.message


def test_bad_token_stops_the_worker_with_a_config_exit_status(tmp_path, api, caplog):
    fake, server = api
    with running_agent(write_config(tmp_path, server.url, token="wrong-token")) as (agent, result):
        wait_for("the agent to give up", lambda: bool(result))
    assert result == [EXIT_CONFIG]
    assert "token_file" in caplog.text and "wrong-token" not in caplog.text
    assert len(fake.names("lease")) == 0  # refused before it was recorded


def test_pending_reports_are_delivered_before_asking_for_work(tmp_path, api):
    fake, server = api
    config = write_config(tmp_path, server.url)
    old = CompleteIn(outcome="failed", failure=Failure(kind="crash", message="from the previous run"))
    Outbox(tmp_path / "outbox").put("L-old", old)
    with running_agent(config):
        wait_for("a lease request", lambda: len(fake.names("lease")) >= 1)
    assert fake.calls[0][:2] == ("complete", "L-old")
    assert fake.reports()["L-old"] == old
    assert len(Outbox(tmp_path / "outbox")) == 0


def test_report_stays_in_the_outbox_while_the_api_refuses_it_and_no_new_work_is_taken(tmp_path, api):
    fake, server = api
    fake.queue = [lease_body("L-1", target="not-here"), lease_body("L-2", target="not-here")]
    fake.complete_status = 503
    with running_agent(write_config(tmp_path, server.url)):
        wait_for("repeated delivery attempts", lambda: len(fake.names("complete")) >= 3)
        # The report is on disk, and the worker did not take L-2 (the API would have handed L-1
        # back, or the L-1 result would wait behind new work).
        assert [i.lease_id for i in Outbox(tmp_path / "outbox").pending()] == ["L-1"]
        assert fake.names("lease") == ["w1"]
        with fake.lock:
            fake.complete_status = None
        wait_for("both reports", lambda: set(fake.completed) == {"L-1", "L-2"})
    assert len(Outbox(tmp_path / "outbox")) == 0


def test_api_restart_loses_no_report(tmp_path, api):
    fake, server = api
    config = write_config(tmp_path, server.url)
    server.stop()
    report = CompleteIn(outcome="failed", failure=Failure(kind="oom", message="measured while the API was down"))
    Outbox(tmp_path / "outbox").put("L-7", report)
    with running_agent(config):
        time.sleep(0.5)  # the agent retries against a closed port meanwhile
        assert len(Outbox(tmp_path / "outbox")) == 1
        server.start()
        wait_for("delivery after the restart", lambda: "L-7" in fake.completed)
    assert fake.reports()["L-7"] == report


def test_rejected_report_is_kept_aside_and_the_loop_goes_on(tmp_path, api):
    fake, server = api
    fake.queue = [lease_body("L-1", target="not-here")]
    fake.complete_status = 422
    with running_agent(write_config(tmp_path, server.url)):
        wait_for("the rejected report", lambda: (tmp_path / "outbox" / "rejected" / "L-1.json").exists())
        wait_for("the loop to go on", lambda: len(fake.names("lease")) >= 2)


def test_sigterm_while_idle_exits_zero(tmp_path, api):
    fake, server = api
    with worker_process(write_config(tmp_path, server.url)) as (proc, log_text):
        wait_for("the worker to poll", lambda: len(fake.names("lease")) >= 2, 120, context=log_text)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        assert proc.returncode == 0, log_text()
        assert "SIGTERM received" in log_text() and TOKEN not in log_text()


def test_bad_config_exits_with_a_clear_message(tmp_path):
    config = tmp_path / "worker.toml"
    config.write_text('api_url = "ftp://x"\ntoken_file = "t"\n')
    done = subprocess.run(
        [sys.executable, "-m", "workers.main", str(config)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == EXIT_CONFIG
    assert "api_url" in done.stderr and "http(s)" in done.stderr


def test_a_worker_whose_engine_cannot_import_refuses_to_start_and_takes_no_lease(tmp_path, api):
    # A venv without the engine (as a worker-only install without the `sim` extra once was).
    bare = tmp_path / "bare-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=600)
    fake, server = api
    config = write_config(tmp_path, server.url)
    config.write_text(config.read_text().replace(f'python = "{sys.executable}"', f'python = "{bare}/bin/python"'))
    done = subprocess.run(
        [sys.executable, "-m", "workers.main", str(config)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == EXIT_CONFIG, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    # (the bare venv may still find spectune_sim on an inherited PYTHONPATH; then uvicorn is missing)
    assert "engine.module: spectune_sim does not import" in errors[0] and "No module named" in errors[0]
    assert fake.names("lease") == []


# -- tests with the real launcher and the simulated engine -----------------------------------


@needs_simulator
def test_trial_runs_end_to_end_with_heartbeats_progress_and_metrics(tmp_path, api):
    fake, server = api
    fake.queue = [lease_body("L-1")]
    with running_agent(write_config(tmp_path, server.url)) as (agent, _):
        wait_for("the trial's report", lambda: "L-1" in fake.completed, 120)
        wait_for("the server to be stopped", lambda: agent.launcher.current is None, 60)
    report = fake.reports()["L-1"]
    assert report.outcome == "ok" and report.metrics is not None
    assert [lv.concurrency for lv in report.metrics.levels] == [1, 2]
    assert all(lv.output_tok_s > 0 for lv in report.metrics.levels)
    assert report.metrics.sglang_version == "0.5.23" and report.metrics.startup_s is not None
    assert report.metrics.effective.get("speculative_num_steps") == 3
    steps = [body["step"] for e, lid, body in fake.calls if e == "progress" and lid == "L-1"]
    assert steps == [0, 1]
    assert "L-1" in fake.names("heartbeat")


@needs_simulator
def test_prune_stops_the_benchmark_and_reports_the_levels_measured(tmp_path, api):
    fake, server = api
    fake.queue = [lease_body("L-1")]
    fake.progress_action["L-1"] = "prune"
    with running_agent(write_config(tmp_path, server.url)):
        wait_for("the pruned trial's report", lambda: "L-1" in fake.completed, 120)
    report = fake.reports()["L-1"]
    assert report.outcome == "ok" and report.metrics is not None
    assert [lv.concurrency for lv in report.metrics.levels] == [1]


@needs_simulator
def test_lost_lease_stops_the_server_and_reports_nothing(tmp_path, api):
    fake, server = api
    body = lease_body("L-1")
    body["workload"]["num_prompts"] = 200  # long enough to be running when the loss is noticed
    fake.queue = [body, lease_body("L-2", target="not-here")]
    fake.heartbeat_status["L-1"] = 410
    with running_agent(write_config(tmp_path, server.url)) as (agent, _):
        wait_for("the next lease's report", lambda: "L-2" in fake.completed, 120)
        assert agent.launcher.current is None
    assert "L-1" not in fake.names("complete")
    assert processes_mentioning(str(tmp_path / "models")) == []


@needs_simulator
def test_sigterm_during_startup_reports_lost_and_leaves_no_process(tmp_path, api):
    fake, server = api
    fake.queue = [lease_body("L-1")]
    # Start-up takes ~10 s here; the first heartbeat comes 0.2 s into the lease.
    with worker_process(write_config(tmp_path, server.url, time_scale=0.4)) as (proc, log_text):
        wait_for("the lease to start", lambda: "L-1" in fake.names("heartbeat"), 120, context=log_text)
        assert "ready after" not in log_text()
        proc.send_signal(signal.SIGTERM)
        proc.wait(90)
        assert proc.returncode == 0, log_text()
    report = fake.reports()["L-1"]
    assert report.failure is not None and report.failure.kind == "lost"
    assert report.failure.message == "worker shutting down"
    assert processes_mentioning(str(tmp_path)) == []


@needs_simulator
def test_second_sigterm_kills_the_server_group_and_exits_at_once(tmp_path, api):
    fake, server = api
    fake.queue = [lease_body("L-1")]
    with worker_process(write_config(tmp_path, server.url, time_scale=0.4)) as (proc, log_text):
        wait_for(
            "the server to start", lambda: processes_mentioning(str(tmp_path / "models")) != [], 120, context=log_text
        )
        proc.send_signal(signal.SIGTERM)
        wait_for("the first signal to be seen", lambda: "SIGTERM received" in log_text(), 30, context=log_text)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert proc.returncode == 128 + signal.SIGTERM, log_text()
    wait_for("the server group to die", lambda: processes_mentioning(str(tmp_path / "models")) == [], 10)


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains `text` (the test's own model paths are unique to it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


@needs_simulator
def test_oom_is_reported_with_its_kind_and_the_worker_goes_on(tmp_path, api):
    fake, server = api
    # The 24 GB landscape cannot capture CUDA graphs up to batch 256 next to its weights.
    oom = lease_body("L-1", target="small-gpu")
    oom["server"].update(max_running_requests=256, cuda_graph_max_bs=256)
    fake.queue = [oom, lease_body("L-2")]
    with running_agent(write_config(tmp_path, server.url)):
        wait_for("both reports", lambda: {"L-1", "L-2"} <= set(fake.completed), 120)
    reports = fake.reports()
    failure = reports["L-1"].failure
    assert reports["L-1"].outcome == "failed" and failure is not None
    assert failure.kind == "oom" and not failure.host_fault and failure.log_tail
    assert reports["L-2"].outcome == "ok"


@needs_simulator
def test_api_down_during_the_benchmark_the_result_arrives_from_the_outbox(tmp_path, api):
    fake, server = api
    body = lease_body("L-1")
    # About 3 s of decoding after the first level: the API is down well before the report.
    body["workload"].update(output_len=128, num_prompts=8, warmup_requests=0)
    fake.queue = [body]
    outbox = Outbox(tmp_path / "outbox")
    with running_agent(write_config(tmp_path, server.url)):
        wait_for("the first level", lambda: "L-1" in fake.names("progress"), 120)
        server.stop()
        wait_for("the report to wait in the outbox", lambda: len(outbox) == 1, 60)
        assert "L-1" not in fake.completed
        server.start()
        wait_for("delivery after the API came back", lambda: "L-1" in fake.completed, 60)
    report = fake.reports()["L-1"]
    assert report.outcome == "ok" and report.metrics is not None and len(report.metrics.levels) == 2
    assert len(outbox) == 0


class FourGpus:
    """A GpuProbe (workers.gpu) for a host with four GPUs: what NVML would report."""

    def devices(self):
        from workers.gpu import GpuDevice

        return [GpuDevice(i, "NVIDIA H200", f"GPU-{i}", 143771.0, 0.0) for i in range(4)]

    def compute_processes(self):
        return []

    def driver_version(self):
        return "580.65.06"


def test_inventory_lists_the_configured_gpus_and_derives_placement_labels():
    from workers.inventory import build_inventory

    inv = build_inventory(
        sglang_version="0.5.23",
        models=["b", "a"],
        labels={"zone": "z1"},
        probe=FourGpus(),
        gpus=[0, 2],
        hostname="gpu-7",
    )
    assert [g.index for g in inv.gpus] == [0, 2] and inv.gpus[0].memory_mib == 143771
    assert inv.driver_version == "580.65.06" and inv.models == ["a", "b"]
    assert inv.labels == {"gpu_count": "2", "gpu_model": "NVIDIA H200", "zone": "z1"}
    # Labels from the config win over derived ones; no NVML means no GPUs and no driver.
    bare = build_inventory(sglang_version="0.5.23", models=[], labels={"gpu_count": "8"}, probe=None)
    assert bare.gpus == [] and bare.driver_version is None and bare.labels == {"gpu_count": "8"}


def test_the_config_digest_changes_with_whatever_can_end_a_refusal(tmp_path):
    """The API ends a worker's refusals when its digest changes: an upgraded SGLang or another
    engine cures an unknown flag, other GPUs cure an OOM, so each must change it."""
    from workers.inventory import config_digest, gpu_inventory

    (tmp_path / "p.jsonl").write_text("{}\n")
    gpus = gpu_inventory(FourGpus(), [0, 2])[0]
    base: dict[str, Any] = {
        "allowed_extra_args": ["--a"],
        "models": {"m": tmp_path},
        "prompt_dir": tmp_path,
        "files": ["p.jsonl"],
        "sglang_version": "0.5.23",
        "engine_python": "/opt/sglang/bin/python",
        "engine_module": "sglang.launch_server",
        "gpus": gpus,
    }
    digest = config_digest(**base)
    assert config_digest(**base) == digest  # the same host, the same digest
    changes = {
        "allowed_extra_args": ["--a", "--b"],
        "models": {"m": tmp_path / "other"},
        "files": [],
        "sglang_version": "0.5.24",
        "engine_python": "/opt/sglang-next/bin/python",
        "engine_module": "spectune_sim",
        "gpus": gpu_inventory(FourGpus(), [0, 1])[0],
    }
    for key, value in changes.items():
        assert config_digest(**(base | {key: value})) != digest, key
    assert config_digest(**(base | {"gpus": []})) != digest  # no GPUs (or other ones) found
