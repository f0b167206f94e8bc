"""An adaptive deployment in a lease: typed, bounded steps per batch size; the worker writes the
config file itself and starts SGLang (here the simulator) with `--speculative-adaptive`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from optimizer.sglang import AdaptiveSteps, ServerSettings, adaptive_refusal, build_server_args
from optimizer.space import SpecConfig
from spectune_protocol import LeaseOut
from tests.workers.test_agent import ApiServer, FakeApi
from tests.workers.test_launcher_process import launch, sim_engine
from workers.agent import server_settings_refusal
from workers.config import DEFAULT_ALLOWED_EXTRA_ARGS, RESERVED_FLAGS
from workers.launcher import Launcher

CHAIN = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)


def server(adaptive: Any = None, **changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "target": "dense-8b-h100",
        "draft": "dense-8b-eagle3",
        "max_running_requests": 8,
        "cuda_graph_max_bs": 8,
        "speculative": CHAIN.model_dump(mode="json"),
    }
    if adaptive is not None:
        doc["adaptive"] = adaptive
    return doc | changes


def lease(srv: dict[str, Any]) -> LeaseOut:
    return LeaseOut.model_validate(
        {
            "lease_id": "l1",
            "kind": "confirm",
            "study": "s",
            "trial_number": None,
            "attempt": 1,
            "deadline": "2026-12-01T00:00:00Z",
            "heartbeat_interval_s": 1.0,
            "server": srv,
            "workload": {"concurrency": [1, 8]},
        }
    )


def test_a_lease_carries_the_steps_per_batch_size_as_numbers() -> None:
    got = lease(server({"steps_by_batch": {"1": 3, "8": 0}})).server
    assert got.adaptive == AdaptiveSteps(steps_by_batch={1: 3, 8: 0})
    assert got.adaptive.config_doc() == {"1": {"candidate_steps": [3]}, "8": {"candidate_steps": [0]}}
    # A static server's lease is what it was before adaptive mode existed: no such key at all.
    assert "adaptive" not in lease(server()).server.model_dump(mode="json")


@pytest.mark.parametrize(
    ("adaptive", "changes"),
    [
        ({"steps_by_batch": {}}, {}),  # no slot
        ({"steps_by_batch": {"0": 3}}, {}),  # batch sizes start at 1
        ({"steps_by_batch": {"5000": 3}}, {}),  # beyond any captured batch
        ({"steps_by_batch": {"1": 3, "8": 65}}, {}),  # deeper than any chain
        ({"steps_by_batch": {"1": 3, "8": -1}}, {}),
        ({"steps_by_batch": {"1": "3"}}, {}),  # numbers only
        ({"steps_by_batch": {"1": True}}, {}),
        ({"steps_by_batch": {"1": 0}}, {}),  # off everywhere: not an adaptive server
        ({"steps_by_batch": {str(b): 3 for b in range(1, 66)}}, {}),  # more slots than the bound
        ({"steps_by_batch": {"1": 3}, "path": "/etc/passwd"}, {}),  # no path, no file text
        ({"steps_by_batch": {"1": 3}, "config_text": "{}"}, {}),
        ({"steps_by_batch": {"1": 2, "8": 0}}, {}),  # num_steps 3 is not among the steps
        ({"steps_by_batch": {"1": 3}}, {"speculative": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}),
        ({"steps_by_batch": {"1": 3}}, {"speculative": None}),
        ("1:3", {}),
    ],
)
def test_a_lease_with_a_bad_adaptive_deployment_is_unreadable(adaptive: Any, changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        lease(server(adaptive, **changes))


def test_the_flags_are_the_workers_own_never_an_extra_arg() -> None:
    assert {"--speculative-adaptive", "--speculative-adaptive-config"} <= RESERVED_FLAGS
    assert not {"--speculative-adaptive", "--speculative-adaptive-config"} & set(DEFAULT_ALLOWED_EXTRA_ARGS)
    allowed = frozenset(DEFAULT_ALLOWED_EXTRA_ARGS)
    sneaky = ServerSettings.model_validate(server(extra_args={"--speculative-adaptive-config": "x"}))
    assert "not on this worker's allowlist" in (server_settings_refusal(sneaky, allowed) or "")


def test_an_adaptive_server_its_sglang_cannot_run_is_not_launched() -> None:
    off_at_8 = ServerSettings.model_validate(server({"steps_by_batch": {"1": 3, "8": 0}}))
    chains = ServerSettings.model_validate(server({"steps_by_batch": {"1": 3, "8": 1}}))
    assert off_at_8.adaptive is not None and chains.adaptive is not None
    assert adaptive_refusal("0.5.23", off_at_8.adaptive) is None
    assert "0.5.16" in (adaptive_refusal("0.5.13", off_at_8.adaptive) or "")
    assert adaptive_refusal("0.5.13", chains.adaptive) is None
    assert "no --speculative-adaptive" in (adaptive_refusal("0.5.10", chains.adaptive) or "")
    with pytest.raises(ValueError, match="0.5.16"):
        build_server_args(
            off_at_8, version="0.5.13", model_path="/m", draft_model_path="/d", adaptive_config_path="/run/a.json"
        )
    args = build_server_args(
        off_at_8, version="0.5.23", model_path="/m", draft_model_path="/d", adaptive_config_path="/run/a.json"
    )
    assert args[args.index("--speculative-adaptive-config") + 1] == "/run/a.json"
    assert "--speculative-adaptive" in args
    with pytest.raises(ValueError, match="path of its adaptive config"):
        build_server_args(off_at_8, version="0.5.23", model_path="/m", draft_model_path="/d")


@pytest.fixture
def launchers() -> Iterator[list[Launcher]]:
    made: list[Launcher] = []
    yield made
    for launcher in made:
        launcher.stop()


def test_the_launcher_writes_the_config_in_its_own_folder_and_sglang_runs_it(
    tmp_path: Path, launchers: list[Launcher]
) -> None:
    launcher = Launcher(sim_engine(tmp_path))
    launchers.append(launcher)
    settings = ServerSettings.model_validate(server({"steps_by_batch": {"1": 3, "8": 0}}))
    first = launch(launcher, settings)
    path = Path(first.argv[first.argv.index("--speculative-adaptive-config") + 1])
    # Its own file, in the worker's log folder, named after the launch; the text is the lease's steps.
    assert path.parent == tmp_path / "logs" and path.name == first.log_path.stem + ".adaptive.json"
    assert json.loads(path.read_text()) == {"1": {"candidate_steps": [3]}, "8": {"candidate_steps": [0]}}
    assert "--speculative-adaptive" in first.argv
    assert first.effective["speculative_adaptive"] is True and first.mismatches == {}
    assert first.server_info["speculative_adaptive_config"] == str(path)
    second = launch(launcher, settings)
    other = Path(second.argv[second.argv.index("--speculative-adaptive-config") + 1])
    assert other != path and path.exists(), "each launch writes a new file; none is overwritten"


def test_a_server_that_switched_adaptive_mode_off_is_a_mismatch(tmp_path: Path, launchers: list[Launcher]) -> None:
    launcher = Launcher(sim_engine(tmp_path))
    launchers.append(launcher)
    settings = ServerSettings.model_validate(
        server({"steps_by_batch": {"1": 3}}, extra_args={"--enable-dp-attention": True})
    )
    started = launch(launcher, settings)
    assert started.mismatches["speculative_adaptive"] == (True, False)


@pytest.fixture
def fake_api() -> Iterator[tuple[FakeApi, ApiServer]]:
    fake = FakeApi()
    server = ApiServer(fake)
    server.start()
    yield fake, server
    server.stop()


def test_a_worker_whose_sglang_cannot_run_it_reports_it_as_sglang_would_without_a_launch(
    tmp_path: Path, fake_api: tuple[FakeApi, ApiServer]
) -> None:
    """SGLang 0.5.13 has adaptive mode but no steps 0: the lease fails `invalid_config` (what that
    SGLang would do at start-up), not a refusal of the study, and nothing is started."""
    from tests.support.helpers import sim_worker_toml, wait_for, write_token
    from tests.workers.test_agent import TOKEN, lease_body, running_agent

    fake, srv = fake_api
    write_token(tmp_path, TOKEN)
    for name in ("dense-8b-h100", "eagle3-draft"):
        (tmp_path / "models" / name).mkdir(parents=True, exist_ok=True)
    (tmp_path / "prompts").mkdir(exist_ok=True)
    config = tmp_path / "worker.toml"
    config.write_text(
        sim_worker_toml(
            api_url=srv.url,
            worker_id="w1",
            top={"prompt_dir": "prompts", "idle_poll_s": 0.05, "idle_poll_max_s": 0.2},
            engine={"sglang_version": "0.5.13", "log_dir": str(tmp_path / "logs")},
            timeouts={"startup_s": 60, "stop_s": 10, "api_s": 5, "api_retry_max_s": 0.5},
            models={"llama": "models/dense-8b-h100", "eagle": "models/eagle3-draft"},
        )
    )
    body = lease_body("L-1", kind="confirm", trial_number=None)
    body["server"]["adaptive"] = {"steps_by_batch": {"1": 3, "2": 0}}
    fake.queue = [body]
    with running_agent(config):
        wait_for("the report", lambda: "L-1" in fake.completed)
    failure = fake.reports()["L-1"].failure
    assert failure is not None and failure.kind == "invalid_config" and not failure.host_fault
    assert "0.5.16" in failure.message
    assert not list((tmp_path / "logs").glob("server-*")), "nothing was launched or written"
