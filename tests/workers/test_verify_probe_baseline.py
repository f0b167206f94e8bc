"""The worker's baseline path runs the verify probe on its warm server and reports it (issue 31 item 2).

A real agent (tests/workers/test_agent.py's scripted lease API on 127.0.0.1) launches the
simulated engine: a baseline lease's report carries `verify_probe` at the workload's levels, a
trial's does not, and the probe's requests go to the worker's own server on loopback only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from optimizer.verify_probe import PROBE_TOKENS, ProbePlan
from spectune_sim.landscapes import get_landscape
from tests.support.helpers import sim_worker_toml, wait_for, write_token
from tests.workers.test_agent import TOKEN, ApiServer, FakeApi, lease_body
from workers.agent import Agent
from workers.client import make_http_client
from workers.config import load_config
from workers.loadgen.probe import run_verify_probe
from workers.main import build_agent

SPEED = 0.05  # a forward of ~133 ms: the tile step (29 ms) stands above the call's own jitter


@pytest.fixture
def fake_api() -> Iterator[tuple[FakeApi, ApiServer]]:
    fake = FakeApi()
    server = ApiServer(fake)
    server.start()
    yield fake, server
    server.stop()


def _config(tmp_path: Path, api_url: str) -> Path:
    write_token(tmp_path, TOKEN)
    for name in ("zigzag-tiles", "eagle3-draft"):
        (tmp_path / "models" / name).mkdir(parents=True, exist_ok=True)
    (tmp_path / "prompts").mkdir(exist_ok=True)
    path = tmp_path / "worker.toml"
    path.write_text(
        sim_worker_toml(
            api_url=api_url,
            worker_id="w1",
            top={"prompt_dir": "prompts", "idle_poll_s": 0.05, "idle_poll_max_s": 0.2},
            engine_env={"SPECTUNE_SIM_TIME_SCALE": "0.01", "SPECTUNE_SIM_SPEED": str(SPEED), "SPECTUNE_SIM_NOISE": "0"},
            timeouts={"startup_s": 60, "stop_s": 10, "api_s": 5, "api_retry_max_s": 0.5},
            models={"tiles": "models/zigzag-tiles", "eagle": "models/eagle3-draft"},
        )
    )
    return path


WORKLOAD = {"concurrency": [1, 2], "num_prompts": 2, "output_len": 2, "warmup_requests": 0, "repeats": 1}


@contextlib.contextmanager
def watched_agent(config: Path, urls: list[str]) -> Iterator[Agent]:
    """The agent of `config` looping in a thread, its probe recording the address it is sent to."""
    cfg = load_config(config)
    stop = threading.Event()

    def probe(base_url: str, plan: ProbePlan, **kw: Any) -> Any:
        urls.append(base_url)
        return run_verify_probe(base_url, plan, **kw)

    with make_http_client(cfg.api_url, timeout_s=cfg.timeouts.api_s) as http:
        agent = build_agent(cfg, stop_event=stop, http=http)
        agent._run_probe = probe
        thread = threading.Thread(target=agent.run, daemon=True)
        thread.start()
        try:
            yield agent
        finally:
            agent.request_stop("test finished")
            thread.join(60)
            assert not thread.is_alive(), "the agent did not stop within 60 s"


def test_a_baseline_reports_its_verify_probe_and_a_trial_none(
    tmp_path: Path, fake_api: tuple[FakeApi, ApiServer]
) -> None:
    fake, server = fake_api
    urls: list[str] = []
    fake.queue = [
        lease_body("B-1", target="tiles", draft=None, workload=WORKLOAD),
        lease_body("T-1", target="tiles", workload=WORKLOAD),
    ]
    with watched_agent(_config(tmp_path, server.url), urls) as agent:
        wait_for("both reports", lambda: {"B-1", "T-1"} <= set(fake.completed), 240)
        wait_for("the server to be stopped", lambda: agent.launcher.current is None, 60)
    reports = fake.reports()
    base, trial = reports["B-1"], reports["T-1"]
    assert base.outcome == "ok" and base.metrics is not None and trial.metrics is not None
    assert trial.metrics.verify_probe is None
    probe = base.metrics.verify_probe
    assert probe is not None and probe.note is None and probe.cached_share == 1.0
    assert {(p.concurrency, p.tokens) for p in probe.points} == {(b, k) for b in (1, 2) for k in PROBE_TOKENS}
    # Its cost is counted: the seconds it took are reported, at least those of its timed calls.
    assert probe.spent_s >= sum(sum(p.seconds_runs) for p in probe.points)
    # The tile step of the engine's forward shows in what the worker reports (16 -> 32 at batch 1).
    t = {(p.concurrency, p.tokens): p.seconds for p in probe.points}
    step = get_landscape("zigzag-tiles").verify_tile_jump * get_landscape("zigzag-tiles").decode_ms / 1000 / SPEED
    assert (t[(1, 32)] - t[(1, 16)]) - (t[(1, 16)] - t[(1, 8)]) > 0.5 * step
    # Only the worker's own server, on loopback, was probed, once (the baseline).
    assert len(urls) == 1 and urls[0].startswith("http://127.0.0.1:")
