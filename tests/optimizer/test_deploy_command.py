"""The exported launch command serves the study's envelope, not the benchmark's (optimizer/deploy.py)."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from optimizer.answer import ADAPTIVE_FILE, adaptive_export, check_adaptive_config
from optimizer.deploy import Deployment, deployment_settings, placeholder, plan_deployment
from optimizer.errors import SpecError
from optimizer.plan import server_settings
from optimizer.space import SpecConfig
from optimizer.spec import parse_spec

TREE = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)


def spec(**extra: Any) -> Any:
    doc: dict[str, Any] = {
        "name": "d",
        "model": {"target": "tgt", "draft": "drf"},
        "workload": {"concurrency": [1, 4]},
    }
    doc.update(extra)
    return parse_spec(doc)


def argv(command: str) -> list[str]:
    return shlex.split(command.splitlines()[-1])


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_serving_section_sizes_the_deployed_server() -> None:
    s = spec(serving={"max_running_requests": 128, "max_batch": 64})
    dep = plan_deployment(s, TREE, pays=True, exported=None, version="0.5.23")
    assert dep is not None and dep.mode == "static"
    args = argv(dep.command())
    assert flag(args, "--max-running-requests") == "128"
    assert flag(args, "--cuda-graph-max-bs-decode") == "64"
    assert "--cuda-graph-bs-decode" not in args  # not the benchmark's capture list
    assert flag(args, "--speculative-num-draft-tokens") == "6"
    assert flag(args, "--host") == "127.0.0.1"
    # Registry names are never printed as paths: a marked placeholder, or the worker's registry.
    assert flag(args, "--model-path") == placeholder("tgt")
    assert flag(args, "--speculative-draft-model-path") == placeholder("drf")
    real = argv(dep.command(models={"tgt": "/srv/t", "drf": "/srv/d"}, host="0.0.0.0", port=31000))
    assert flag(real, "--model-path") == "/srv/t" and flag(real, "--speculative-draft-model-path") == "/srv/d"
    assert flag(real, "--host") == "0.0.0.0" and flag(real, "--port") == "31000"
    # max_batch defaults to max_running_requests.
    only = plan_deployment(spec(serving={"max_running_requests": 96}), TREE, pays=True, exported=None, version="0.5.13")
    assert only is not None
    assert flag(argv(only.command()), "--cuda-graph-max-bs") == "96"  # the old flag name on 0.5.13


def test_trials_run_with_the_serving_pool_but_capture_only_the_benchmarked_sizes() -> None:
    s = spec(serving={"max_running_requests": 128})
    trial = server_settings(s, TREE)
    assert trial.max_running_requests == 128 and trial.cuda_graph_bs == (1, 4)
    assert server_settings(s, None).max_running_requests == 128  # the baseline too: like with like


def test_without_a_serving_section_the_command_admits_only_the_measured_loads() -> None:
    s = spec()
    dep = plan_deployment(s, TREE, pays=True, exported=None, version="0.5.23")
    assert dep is not None
    args = argv(dep.command())
    # SGLang's default with speculation (48 running, graphs to 48) would serve batches nobody
    # measured: the command is sized to the largest measured level, and says so.
    assert flag(args, "--max-running-requests") == "4" and flag(args, "--cuda-graph-max-bs-decode") == "4"
    assert dep.proven_levels == (1, 4)
    assert "proven at concurrency 1, 4" in dep.load_note and "at most 4 running requests" in dep.load_note
    assert "serving.max_running_requests" in dep.load_note
    assert Deployment.from_json(dep.as_json()).load_note == dep.load_note
    # The line printed above the command, read from the server it runs.
    assert dep.load_line() == "proven at concurrency 1, 4; admits at most 4 running requests"
    off = plan_deployment(s, TREE, pays=False, exported=None, version="0.5.23")
    assert off is not None and "admits as many running requests as SGLang sizes" in off.load_line()
    served = plan_deployment(
        spec(serving={"max_running_requests": 64}), TREE, pays=True, exported=None, version="0.5.23"
    )
    assert served is not None and "serving envelope (64 running requests)" in served.load_note
    big = spec(workload={"concurrency": [1, 64]})
    settings, pinned = deployment_settings(big, TREE)
    assert pinned and settings.max_running_requests == 64 and settings.cuda_graph_max_bs == 64
    # Without speculation SGLang has no such cap: neither flag is printed.
    plain = plan_deployment(s, TREE, pays=False, exported=None, version="0.5.23")
    assert plain is not None and plain.mode == "no_speculation" and not plain.speculation
    args = argv(plain.command())
    assert "--max-running-requests" not in args and not any(a.startswith("--cuda-graph") for a in args)
    assert not any(a.startswith("--speculative") for a in args)


def test_no_speculation_with_a_serving_section_keeps_the_envelope() -> None:
    s = spec(serving={"max_running_requests": 200, "max_batch": 160})
    dep = plan_deployment(s, TREE, pays=False, exported=None, version="0.5.23")
    assert dep is not None
    args = argv(dep.command())
    assert flag(args, "--max-running-requests") == "200" and flag(args, "--cuda-graph-max-bs-decode") == "160"
    assert not any(a.startswith("--speculative") for a in args)
    assert Deployment.from_json(dep.as_json()).command() == dep.command()


def test_serving_section_errors_suggest_the_fix() -> None:
    with pytest.raises(SpecError, match="raise it to at least 4") as e:
        spec(serving={"max_running_requests": 2})
    assert e.value.field == "serving.max_running_requests"
    with pytest.raises(SpecError, match="leave max_batch out or lower it"):
        spec(serving={"max_running_requests": 8, "max_batch": 16})


def _trial(number: int, config: SpecConfig, by_level: dict[int, float]) -> Any:
    return create_trial(
        state=TrialState.COMPLETE,
        value=min(by_level.values()),
        params={"num_steps": config.num_steps},
        distributions={"num_steps": IntDistribution(1, 10)},
        user_attrs={
            "config": config.model_dump(mode="json"),
            "speedup_by_level": {str(k): v for k, v in by_level.items()},
            "levels": [],
        },
    )


def test_per_level_winners_that_differ_deploy_sglangs_adaptive_mode(tmp_path: Path) -> None:
    s = spec(workload={"concurrency": [1, 16]})
    deep = SpecConfig(num_steps=5, topk=1, num_draft_tokens=6)
    shallow = SpecConfig(num_steps=2, topk=1, num_draft_tokens=3)
    trials = [_trial(0, deep, {1: 1.8, 16: 1.1}), _trial(1, shallow, {1: 1.5, 16: 1.3})]
    trials[1].number = 1
    exported = adaptive_export(s, trials)
    assert exported is not None and exported.fits
    dep = plan_deployment(s, deep, pays=True, exported=exported, version="0.5.23")
    assert dep is not None and dep.mode == "adaptive"
    text = dep.command(models={"tgt": "/m/t", "drf": "/m/d"})
    args = argv(text)
    assert flag(args, "--speculative-adaptive-config") == ADAPTIVE_FILE and "--speculative-adaptive" in args
    assert flag(args, "--speculative-eagle-topk") == "1" and flag(args, "--max-running-requests") == "16"
    # As printed, the lines before the server write the config file SGLang reads.
    setup = "\n".join(text.splitlines()[:-1])
    subprocess.run(["bash", "-c", setup], cwd=tmp_path, check=True)
    written = json.loads((tmp_path / ADAPTIVE_FILE).read_text())
    assert written == {"1": {"candidate_steps": [5]}, "16": {"candidate_steps": [2]}}
    steps = int(flag(args, "--speculative-num-steps") or 0)
    assert check_adaptive_config(written, initial_steps=steps, topk=1) == []
    # One named objective level: its own winner, statically.
    single = spec(workload={"concurrency": [1, 16]}, objective={"concurrency": 16})
    static = plan_deployment(single, shallow, pays=True, exported=adaptive_export(single, trials), version="0.5.23")
    assert static is not None and static.mode == "static"
    # The same steps at every level: nothing to switch, static.
    same = [_trial(0, deep, {1: 1.8, 16: 1.3})]
    exported_same = adaptive_export(s, same)
    flat = plan_deployment(s, deep, pays=True, exported=exported_same, version="0.5.23")
    assert flat is not None and flat.mode == "static"


def test_a_chain_that_pays_at_part_of_the_load_is_deployed_adaptively() -> None:
    """The issue's MoE on PCIe: ~4% at concurrency 1 with a chain, a loss at 8: not "does not pay"."""
    s = spec(workload={"concurrency": [1, 8]})
    chain = SpecConfig(num_steps=2, topk=1, num_draft_tokens=3)
    trials = [_trial(0, chain, {1: 1.04, 8: 0.93})]
    with_spread = trials[0].user_attrs
    with_spread["levels"] = [
        {"concurrency": 1, "output_tok_s": 104.0, "output_tok_s_runs": [103.9, 104.0, 104.1]},
        {"concurrency": 8, "output_tok_s": 93.0, "output_tok_s_runs": [92.9, 93.0, 93.1]},
    ]
    with_spread["baseline_levels"] = [
        {"concurrency": 1, "output_tok_s": 100.0, "output_tok_s_runs": [99.9, 100.0, 100.1]},
        {"concurrency": 8, "output_tok_s": 100.0, "output_tok_s_runs": [99.9, 100.0, 100.1]},
    ]
    exported = adaptive_export(s, trials)
    assert exported is not None and exported.config == {"1": {"candidate_steps": [2]}, "8": {"candidate_steps": [0]}}
    # Over both levels it does not pay (geometric mean ~0.98): still, speculation where it pays.
    dep = plan_deployment(s, chain, pays=False, exported=exported, version="0.5.23")
    assert dep is not None and dep.mode == "adaptive" and dep.speculation
    assert "pays at concurrency 1" in dep.reason and "off (steps 0) at 8" in dep.reason
    args = argv(dep.command())
    assert flag(args, "--speculative-num-steps") == "2" and "--speculative-adaptive" in args
    # Where it pays nowhere, the answer is the server without speculation.
    losing = [_trial(0, chain, {1: 0.97, 8: 0.93})]
    none = plan_deployment(s, chain, pays=False, exported=adaptive_export(s, losing), version="0.5.23")
    assert none is not None and none.mode == "no_speculation"


def test_the_adaptive_file_lists_batch_sizes_in_numeric_order(tmp_path: Path) -> None:
    s = spec(workload={"concurrency": [1, 4, 16]})
    configs = [SpecConfig(num_steps=n, topk=1, num_draft_tokens=n + 1) for n in (5, 3, 2)]
    trials = [
        _trial(0, configs[0], {1: 1.8, 4: 1.2, 16: 1.1}),
        _trial(1, configs[1], {1: 1.5, 4: 1.4, 16: 1.2}),
        _trial(2, configs[2], {1: 1.3, 4: 1.3, 16: 1.3}),
    ]
    for i, t in enumerate(trials):
        t.number = i
    dep = plan_deployment(s, configs[0], pays=True, exported=adaptive_export(s, trials), version="0.5.23")
    assert dep is not None and dep.mode == "adaptive"
    setup = "\n".join(dep.command(models={"tgt": "/m/t", "drf": "/m/d"}).splitlines()[:-1])
    subprocess.run(["bash", "-c", setup], cwd=tmp_path, check=True)
    # As written (sort_keys wrote "1", "16", "4"): json.loads keeps the file's order.
    assert list(json.loads((tmp_path / ADAPTIVE_FILE).read_text())) == ["1", "4", "16"]
