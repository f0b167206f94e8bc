"""The simulated server's adaptive mode (`--speculative-adaptive`): its own statement of SGLang's
rules (spectune_sim/rules.py), and a real server process that runs each batch size's steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from spectune_sim.args import build_parser, resolve
from spectune_sim.landscapes import get_landscape
from spectune_sim.model import predict_adaptive
from spectune_sim.rules import AdaptivePlan
from tests.support.helpers import free_port, wait_serving
from workers.lifeline import child_env

REPO = Path(__file__).resolve().parents[2]
CHAIN = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d"]


def _config(tmp_path: Path, doc: Any) -> str:
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _resolve(version: str, *flags: str) -> Any:
    ns = build_parser(version).parse_args(["--model-path", "/m/moe-pcie", *flags])
    return resolve(ns, get_landscape("moe-pcie"), version)


def test_the_flags_exist_from_0_5_13_and_argparse_refuses_them_before(tmp_path: Path) -> None:
    path = _config(tmp_path, {"1": {"candidate_steps": [3]}})
    with pytest.raises(SystemExit) as e:
        build_parser("0.5.10").parse_args(["--model-path", "m", "--speculative-adaptive"])
    assert e.value.code == 2
    r = _resolve("0.5.13", *CHAIN, "--speculative-adaptive", "--speculative-adaptive-config", path)
    assert r.adaptive is not None and r.adaptive.steps_for(1) == 3


def test_resolution_follows_the_config(tmp_path: Path) -> None:
    path = _config(tmp_path, {"1": {"candidate_steps": [3]}, "8": {"candidate_steps": [0]}, "ema_alpha": 0.5})
    r = _resolve("0.5.23", *CHAIN, "--speculative-adaptive", "--speculative-adaptive-config", path)
    # topk defaults to 1, steps to the middle of the candidate union {0, 3}, draft tokens to steps + 1.
    assert (r.topk, r.num_steps, r.num_draft_tokens) == (1, 3, 4)
    assert r.adaptive == AdaptivePlan(((1, 3), (8, 0)))
    assert [r.adaptive.steps_for(b) for b in (1, 7, 8, 64)] == [3, 3, 0, 0]
    assert r.values["speculative_adaptive"] is True and r.values["speculative_adaptive_config"] == path
    # Steps outside the candidates are refused at start-up.
    with pytest.raises(ValueError, match="not in the adaptive config candidate_steps"):
        _resolve(
            "0.5.23", *CHAIN, "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
            "--speculative-adaptive", "--speculative-adaptive-config", path,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("version", "doc", "error"),
    [
        ("0.5.23", {"knob": 1}, "at least one integer-string BS key"),
        ("0.5.23", {"1": {"candidate_steps": []}}, "candidate_steps must be a list"),
        ("0.5.23", {"1": {"candidate_steps": [-1]}}, "non-negative"),
        ("0.5.23", {"1": {"candidate_steps": ["3"]}}, "non-negative"),
        ("0.5.13", {"1": {"candidate_steps": [3]}, "8": {"candidate_steps": [0]}}, "positive"),
    ],
)
def test_a_bad_config_is_a_start_up_error(tmp_path: Path, version: str, doc: Any, error: str) -> None:
    path = _config(tmp_path, doc)
    with pytest.raises(ValueError, match=error):
        _resolve(version, *CHAIN, "--speculative-adaptive", "--speculative-adaptive-config", path)


def test_adaptive_mode_is_silently_off_for_trees_and_attention_dp(tmp_path: Path) -> None:
    path = _config(tmp_path, {"1": {"candidate_steps": [3]}})
    tree = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"]
    r = _resolve("0.5.23", *CHAIN, *tree, "--speculative-adaptive", "--speculative-adaptive-config", path)
    assert r.adaptive is None and (r.topk, r.num_draft_tokens) == (2, 6)
    assert any("speculative_adaptive disabled" in w for w in r.warnings)
    dp = _resolve(
        "0.5.23", *CHAIN, "--enable-dp-attention", "--speculative-adaptive", "--speculative-adaptive-config", path
    )
    assert dp.adaptive is None


def _stream_rate(url: str, n: int, tokens: int) -> tuple[float, list[dict[str, Any]]]:
    """Output tokens/s of `n` requests sent together, and each one's final meta_info."""
    metas: list[dict[str, Any]] = []
    body = {"text": "Explain speculative decoding.", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
    start = threading.Barrier(n + 1)
    done: list[float] = []

    def one() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            client.get("/health")  # connected before the start: the requests arrive together
            start.wait()
            r = client.post("/generate", json=body)
        metas.append(r.json()["meta_info"])
        done.append(time.monotonic())

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join()
    return n * tokens / (max(done) - t0), metas


def test_a_real_adaptive_server_drafts_where_its_config_says_and_decodes_plainly_elsewhere(tmp_path: Path) -> None:
    """Steps 3 at batch 1, steps 0 from batch 4: one request alone verifies drafts, four together
    do not once all four run, and the two throughputs relate as the model says (a ratio within one process)."""
    port = free_port()
    log_path = tmp_path / "sim.log"
    path = _config(tmp_path, {"1": {"candidate_steps": [3]}, "4": {"candidate_steps": [0]}})
    argv = [
        sys.executable, "-m", "spectune_sim", "--model-path", "/models/moe-pcie", "--port", str(port),
        *CHAIN, "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
        "--max-running-requests", "4", "--cuda-graph-max-bs-decode", "4",
        "--speculative-adaptive", "--speculative-adaptive-config", path,
    ]  # fmt: skip
    env = {
        **os.environ,
        "SPECTUNE_SIM_TIME_SCALE": "0.004",
        "SPECTUNE_SIM_SPEED": "4",
        "SPECTUNE_SIM_NOISE": "0",
        "SPECTUNE_SIM_SGLANG_VERSION": "0.5.23",
    }
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=child_env(env), cwd=REPO, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_serving(url + "/health", proc, log_path, 60)
        info = httpx.get(url + "/server_info", timeout=10).json()
        assert info["speculative_adaptive"] is True and info["speculative_adaptive_config"] == path
        alone, metas1 = _stream_rate(url, 1, 200)
        together, metas4 = _stream_rate(url, 4, 200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # our own process group, by id
            proc.wait(timeout=20)
    assert metas1[0]["spec_verify_ct"] > 0 and metas1[0]["spec_accept_length"] > 1.5
    # Four together drafted only in the cycles before the last of them arrived (a batch under 4).
    assert all(m["completion_tokens"] == 200 and m["spec_verify_ct"] <= 5 for m in metas4), [
        m["spec_verify_ct"] for m in metas4
    ]
    plan = AdaptivePlan(((1, 3), (4, 0)))
    ls = get_landscape("moe-pcie")
    model = {c: predict_adaptive(ls, plan, c, max_running_requests=4, cuda_graph_max_bs=4).output_tok_s for c in (1, 4)}
    assert model[1] > 0 and predict_adaptive(ls, plan, 4, max_running_requests=4).accept_length == 1.0
    assert together / alone == pytest.approx(model[4] / model[1], rel=0.15), (alone, together, model)


@pytest.mark.parametrize("version", ["0.5.10", "0.5.13", "0.5.16", "0.5.20", "0.5.23"])
def test_the_tuner_and_the_simulator_state_the_same_versions(tmp_path: Path, version: str) -> None:
    """Both statements of which SGLang runs which adaptive config (they must not import each other)."""
    from optimizer.sglang import AdaptiveSteps, adaptive_refusal
    from spectune_sim.rules import adaptive_slots, has_adaptive

    for steps in ({1: 3, 8: 1}, {1: 3, 8: 0}):
        tuner_ok = adaptive_refusal(version, AdaptiveSteps(steps_by_batch=steps)) is None
        try:
            sim_ok = has_adaptive(version) and bool(
                adaptive_slots(AdaptiveSteps(steps_by_batch=steps).config_doc(), version)
            )
        except ValueError:
            sim_ok = False
        assert tuner_ok == sim_ok, (version, steps)
