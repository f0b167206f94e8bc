"""The simulated SGLang server as a real subprocess on 127.0.0.1: flags, start-up, endpoints, faults."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from optimizer.space import SpecConfig
from spectune_sim.args import build_parser
from spectune_sim.landscapes import get_landscape
from spectune_sim.model import predict
from tests.support.helpers import free_port, wait_for, wait_serving
from workers.lifeline import child_env

REPO = Path(__file__).resolve().parents[2]
FAST = {"SPECTUNE_SIM_TIME_SCALE": "0.05", "SPECTUNE_SIM_SPEED": "20", "SPECTUNE_SIM_NOISE": "0"}
SPEC_3_1_4 = [
    "--speculative-algorithm", "EAGLE3",
    "--speculative-draft-model-path", "/models/draft",
    "--speculative-num-steps", "3",
    "--speculative-eagle-topk", "1",
]  # fmt: skip


@dataclass
class Sim:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self, timeout: float = 20.0) -> int:
        return self.proc.wait(timeout=timeout)

    def wait_ready(self, timeout: float = 30.0) -> None:
        wait_serving(self.url + "/health", self.proc, self.log_path, timeout)


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[object]:
    started: list[Sim] = []

    def _launch(landscape: str, *flags: str, env: dict[str, str] | None = None) -> Sim:
        port = free_port()
        log_path = tmp_path / f"sim-{port}.log"
        full_env = {**os.environ, **FAST, "SPECTUNE_SIM_SGLANG_VERSION": "0.5.23", **(env or {})}
        argv = [sys.executable, "-m", "spectune_sim", "--model-path", f"/models/{landscape}", "--port", str(port)]
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                [*argv, *flags],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=child_env(full_env),
                cwd=REPO,
                start_new_session=True,
            )
        sim = Sim(proc, port, log_path)
        started.append(sim)
        return sim

    yield _launch
    for sim in started:
        if sim.proc.poll() is None:
            os.killpg(sim.proc.pid, signal.SIGKILL)  # our own process group, by id
            sim.proc.wait(timeout=10)


def sse_events(response: httpx.Response) -> Iterator[tuple[float, Any]]:
    """(arrival time, parsed data) per SSE event; the string '[DONE]' for the end marker."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield time.monotonic(), payload if payload == "[DONE]" else json.loads(payload)


def child_pids(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# -- flags, in-process: the parser the server uses --------------------------------------------------


def test_cuda_graph_flag_names_per_version():
    assert build_parser("0.5.13").parse_args(["--model-path", "m", "--cuda-graph-max-bs", "8"]).cuda_graph_max_bs == 8
    for name in ("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode"):
        assert build_parser("0.5.16").parse_args(["--model-path", "m", name, "8"]).cuda_graph_max_bs == 8
    ns = build_parser("0.5.23").parse_args(["--model-path", "m", "--cuda-graph-bs-decode", "1", "2", "4"])
    assert ns.cuda_graph_bs == [1, 2, 4]
    with pytest.raises(SystemExit) as exc:
        build_parser("0.5.13").parse_args(["--model-path", "m", "--cuda-graph-max-bs-decode", "8"])
    assert exc.value.code == 2
    assert (
        build_parser("0.5.23")
        .parse_args(["--model-path", "m", "--speculative-draft-model", "d"])
        .speculative_draft_model_path
        == "d"
    )
    assert isinstance(build_parser("0.5.23"), argparse.ArgumentParser)


@pytest.mark.parametrize("flag", ["--cuda-graph-max-bs", "--cuda-graph-bs"])
def test_old_graph_flag_is_ambiguous_on_0_5_23(launch, flag):
    sim = launch("dense-8b-h100", flag, "8")
    assert sim.wait_exit() == 2
    assert f"ambiguous option: {flag} could match" in sim.log()


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d", "--speculative-num-steps", "3"], "TypeError"),
        ([*SPEC_3_1_4[:-1], "2", "--speculative-num-draft-tokens", "6", "--attention-backend", "trtllm_mha"], "ValueError: trtllm_mha"),
        ([*SPEC_3_1_4[:-1], "2", "--speculative-num-draft-tokens", "6", "--page-size", "16", "--attention-backend", "flashmla"], "ValueError"),
        (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d", "--speculative-eagle-topk", "2"], "AssertionError"),
    ],
)  # fmt: skip
def test_resolution_errors_exit_1_with_a_traceback(launch, flags, error):
    sim = launch("dense-8b-h100", *flags)
    assert sim.wait_exit() == 1
    log = sim.log()
    assert "Traceback (most recent call last)" in log and error in log


def test_unknown_model_exits_1_with_the_known_names(launch):
    sim = launch("llama-70b")
    assert sim.wait_exit() == 1
    assert "no simulated landscape named 'llama-70b'" in sim.log() and "moe-pcie" in sim.log()


def test_oom_landscape_dies_with_the_cuda_oom_line(launch):
    sim = launch(
        "mem-tight",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
        "--speculative-num-steps", "8", "--speculative-eagle-topk", "8", "--speculative-num-draft-tokens", "64",
        "--max-running-requests", "64", "--cuda-graph-max-bs-decode", "64",
        env={"SPECTUNE_SIM_TIME_SCALE": "0.01"},
    )  # fmt: skip
    assert sim.wait_exit() != 0
    log = sim.log()
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in log
    assert "fired up" not in log


# -- a running server -------------------------------------------------------------------------------


def test_readiness_sequence_resolution_and_streaming(launch):
    sim = launch(
        "dense-8b-h100", *SPEC_3_1_4, "--speculative-num-draft-tokens", "8", "--enable-metrics",
        "--max-running-requests", "8", "--decode-log-interval", "5",
        env={"SPECTUNE_SIM_TIME_SCALE": "0.1"},
    )  # fmt: skip
    seen: list[str] = []
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        assert sim.proc.poll() is None, sim.log()
        try:
            status = str(httpx.get(sim.url + "/health", timeout=1).status_code)
        except httpx.TransportError:
            status = "refused"
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == "200":
            break
        time.sleep(0.01)
    assert seen == ["refused", "503", "200"], seen
    assert httpx.get(sim.url + "/ready").status_code == 200
    assert "The server is fired up and ready to roll!" in sim.log()

    info = httpx.get(sim.url + "/server_info").json()
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == (
        3,
        1,
        4,
    )
    assert info["max_running_requests"] == 8 and info["version"] == "0.5.23" and info["startup_time"] > 0
    assert info["internal_states"][0]["speculative_num_draft_tokens"] == 4
    assert "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1" in sim.log()
    assert httpx.get(sim.url + "/get_server_info").json()["speculative_num_steps"] == 3
    assert httpx.get(sim.url + "/model_info").json()["architectures"] == ["LlamaForCausalLM"]

    body = {
        "text": "Write a haiku about GPUs.",
        "sampling_params": {"max_new_tokens": 96, "ignore_eos": True, "temperature": 0},
        "stream": True,
    }
    events = []
    with httpx.stream("POST", sim.url + "/generate", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [data for _, data in sse_events(r)]
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(isinstance(c, dict) for c in chunks)
    for prev, cur in zip(chunks, chunks[1:], strict=False):
        assert cur["text"].startswith(prev["text"]) and len(cur["text"]) > len(prev["text"])
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert cur["meta_info"]["completion_tokens"] == len(cur["output_ids"])
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["meta_info"]["id"] for c in chunks}) == 1
    assert max(len(b["output_ids"]) - len(a["output_ids"]) for a, b in zip(chunks, chunks[1:], strict=False)) > 1
    final = chunks[-1]["meta_info"]
    assert len(chunks[-1]["output_ids"]) == final["completion_tokens"] == 96
    assert final["finish_reason"] == {"type": "length", "length": 96}
    assert final["spec_accept_length"] == pytest.approx(final["completion_tokens"] / final["spec_verify_ct"])
    assert final["spec_num_proposed_drafts"] == final["spec_verify_ct"] * 3
    assert final["spec_accept_rate"] == pytest.approx(
        final["spec_num_correct_drafts"] / final["spec_num_proposed_drafts"]
    )
    assert final["e2e_latency"] > 0 and final["prompt_tokens"] > 0

    plain = httpx.post(sim.url + "/generate", json={**body, "stream": False}, timeout=30).json()
    assert plain["meta_info"]["completion_tokens"] == 96 and len(plain["output_ids"]) == 96

    comp = {
        "prompt": "Hello",
        "max_tokens": 40,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", sim.url + "/v1/completions", json=comp, timeout=30) as r:
        ev = [data for _, data in sse_events(r)]
    assert ev[-1] == "[DONE]" and ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 40
    text = "".join(e["choices"][0]["text"] for e in ev[:-2])
    assert len(text.split()) == 40 and ev[-3]["choices"][0]["finish_reason"] == "length"

    metrics = httpx.get(sim.url + "/metrics").text
    assert "sglang:spec_verify_calls_total" in metrics and "sglang:generation_tokens_total" in metrics
    # The cumulative accept length is folded in at decode log lines (warmup included), like SGLang's.
    assert "accept len: " in sim.log() and "cuda graph: True, gen throughput (token/s): " in sim.log()
    assert httpx.get(sim.url + "/server_info").json()["internal_states"][0]["avg_spec_accept_length"] > 1.5


def test_metrics_need_enable_metrics_and_baseline_has_no_spec_fields(launch):
    sim = launch("dense-8b-h100", "--max-running-requests", "4")
    sim.wait_ready()
    assert httpx.get(sim.url + "/metrics").status_code == 404
    out = httpx.post(
        sim.url + "/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}},
    ).json()
    assert out["meta_info"]["completion_tokens"] == 10 and "spec_verify_ct" not in out["meta_info"]
    assert httpx.get(sim.url + "/server_info").json()["speculative_algorithm"] is None
    for route in ("/generate", "/v1/completions"):  # a body that is not JSON: a 400 saying so, the server serves on
        r = httpx.post(sim.url + route, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not JSON" in r.text, (route, r.text)
    assert httpx.post(
        sim.url + "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}
    ).is_success


def test_infeasible_tree_starts_but_fails_on_the_first_generate(launch):
    sim = launch(
        "dense-8b-h100", *SPEC_3_1_4[:-1], "2", "--speculative-num-draft-tokens", "16", "--max-running-requests", "4"
    )
    sim.wait_ready()
    r = httpx.post(sim.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 8}}, timeout=30)
    assert r.status_code == 500 and "organize_draft_results" in r.json()["error"]["message"]
    with httpx.stream("POST", sim.url + "/generate", json={"text": "hi", "stream": True}, timeout=30) as s:
        events = [data for _, data in sse_events(s)]
    assert any(isinstance(e, dict) and "error" in e for e in events)
    assert "Scheduler hit an exception" in sim.log()


def test_sigterm_drains_exits_0_and_leaves_no_child(launch):
    sim = launch("dense-8b-h100", "--max-running-requests", "4")
    sim.wait_ready()
    children = child_pids(sim.proc.pid)
    assert children and all(alive(c) for c in children)
    sim.proc.send_signal(signal.SIGTERM)
    assert sim.wait_exit(timeout=15) == 0
    assert not any(alive(c) for c in children)


def test_faults_hang_and_crash(launch):
    hung = launch("dense-8b-h100", env={"SPECTUNE_SIM_FAULT": "hang_startup"})
    crash = launch("dense-8b-h100", env={"SPECTUNE_SIM_FAULT": "crash_after:0.3"})
    crash.wait_ready()
    children = child_pids(crash.proc.pid)
    assert crash.wait_exit(timeout=15) == -signal.SIGSEGV
    deadline = time.monotonic() + 10
    while any(alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)  # the child sees its pipe close and exits by itself
    assert not any(alive(c) for c in children)
    assert hung.proc.poll() is None
    with pytest.raises(httpx.ConnectError):
        httpx.get(hung.url + "/health", timeout=1)
    hung.proc.send_signal(signal.SIGTERM)
    assert hung.wait_exit(timeout=15) == 0


# -- the calibration, measured over the stream -----------------------------------------------------


@pytest.mark.slow
def test_moe_pcie_stream_reproduces_the_calibration(launch):
    speed = 4.0
    env = {"SPECTUNE_SIM_TIME_SCALE": "0.004", "SPECTUNE_SIM_SPEED": str(speed), "SPECTUNE_SIM_NOISE": "0"}
    published = {None: 90.0, 2: 94.0, 5: 71.3, 10: 60.0}
    sims = {}
    for steps in published:
        flags = ["--max-running-requests", "1"]
        if steps is not None:
            flags += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
                      "--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1",
                      "--speculative-num-draft-tokens", str(steps + 1)]  # fmt: skip
        sims[steps] = launch("moe-pcie", *flags, env=env)
    measured = {}
    for steps, sim in sims.items():
        sim.wait_ready(timeout=60)
        body = {
            "text": "Explain speculative decoding.",
            "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
            "stream": True,
        }
        rates = []
        # A busy machine disturbs a stream: a stall slows it, and a late first chunk followed by
        # chunks on their schedule made a rate between the first and the last chunk 5% fast (the
        # baseline read 94.3 tok/s against 90 under busy loops).  The decode rate is the slope of
        # tokens against arrival time over every chunk, and the median of three (a stall and the
        # burst after it can tilt one fit either way: one read 107.7 against 94); a pacing bug
        # (too fast or too slow) shows in all three.
        for _ in range(3):
            with httpx.stream("POST", sim.url + "/generate", json=body, timeout=60) as r:
                events = [(t, d) for t, d in sse_events(r) if d != "[DONE]"]
            assert all(isinstance(d, dict) for _, d in events)
            assert events[-1][1]["meta_info"]["completion_tokens"] == 300
            times = [t for t, _ in events]
            tokens = [float(d["meta_info"]["completion_tokens"]) for _, d in events]
            rates.append(statistics.linear_regression(times, tokens).slope / speed)
        measured[steps] = statistics.median(rates)
        config = None if steps is None else SpecConfig(num_steps=steps, topk=1, num_draft_tokens=steps + 1)
        model = predict(get_landscape("moe-pcie"), config, 1).output_tok_s
        assert measured[steps] == pytest.approx(model, rel=0.05), (steps, measured[steps], model)
        assert measured[steps] == pytest.approx(published[steps], rel=0.05), (steps, measured[steps])
    assert measured[2] > measured[None] > measured[5] > measured[10], measured


def test_the_simulator_stops_when_the_process_that_started_it_is_killed(tmp_path: Path) -> None:
    """A worker SIGKILLed leaves its engine behind; the simulator follows it (spectune_sim/lifeline.py)."""
    port = free_port()
    log_path = tmp_path / "sim.log"
    argv = [sys.executable, "-m", "spectune_sim", "--model-path", "/models/moe-pcie", "--port", str(port)]
    parent_code = (
        "import os, subprocess, sys, time\n"
        "from workers.lifeline import child_env\n"
        f"log = open({str(log_path)!r}, 'ab')\n"
        f"sim = subprocess.Popen({argv!r}, env=child_env({{**os.environ, **{FAST!r}}}), stdout=log,"
        " stderr=subprocess.STDOUT, start_new_session=True)\n"
        "print(sim.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, cwd=REPO, start_new_session=True
    )
    assert parent.stdout is not None
    sim_pid = int(parent.stdout.readline())
    try:
        wait_for("the simulator to serve", lambda: _answers(f"http://127.0.0.1:{port}/health"), 60)
        parent.kill()
        parent.wait(10)
        wait_for("the simulator to stop", lambda: not _running(sim_pid), 30, context=log_path.read_text)
        assert "parent process" in log_path.read_text()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if _running(sim_pid):
            os.killpg(sim_pid, signal.SIGKILL)  # its own group, started by this test


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
