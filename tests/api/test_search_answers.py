"""Per-concurrency answers in GET /v1/studies/{name}, and warm starts from finished studies."""

from __future__ import annotations

from tests.support.api_client import Api
from tests.support.search import drive, key_of, lease
from tests.support.specs import INVENTORY, small_spec


def test_per_level_answers_and_a_later_study_starts_from_them(api: Api) -> None:
    workload = {"output_len": 32, "num_prompts": 4, "concurrency": [1, 16], "repeats": 3}
    first = small_spec("levels-a", workload=workload, budget={"max_trials": 6})
    first["confirmation"] = {"top": 1}
    api.post("/v1/studies", "user", first)
    drive(api, "levels-a", ["w1"], "moe-pcie")
    shown = api.get("/v1/studies/levels-a", "user").json()
    assert shown["state"] == "finished"
    per_level = shown["best_by_level"]
    assert set(per_level) == {"1", "16"}
    trials = {t["number"]: t for t in api.get("/v1/studies/levels-a/trials", "user").json()}
    for level, answer in per_level.items():
        measured = [t["speedup_by_level"][level] for t in trials.values() if t["speedup_by_level"]]
        assert answer["speedup"] == max(measured)
        assert answer["config"] == trials[answer["trial_number"]]["config"]
        assert answer["speedup_interval"]["low"] < answer["speedup"] < answer["speedup_interval"]["high"]
    exported = shown["adaptive_spec"]
    assert exported is not None and exported["reason"]
    if exported["config"] is not None:
        assert set(exported["config"]) == {"1", "16"}
        assert "--speculative-adaptive" in exported["server_args"]
    # Deployed without a serving section: sized to the largest measured load, and saying so.
    assert "--cuda-graph-max-bs-decode 16" in shown["winner"]["launch_command"]
    assert "--max-running-requests 16" in shown["winner"]["launch_command"]
    assert "proven at concurrency 1, 16" in shown["deployment"]["load_note"]
    assert shown["deployment"]["mode"] in ("static", "adaptive", "no_speculation")

    # Same model, same hardware: the next study tries the previous answers first.
    second = small_spec("levels-b", workload=workload, budget={"max_trials": 3})
    api.post("/v1/studies", "user", second)
    # Same server and workload: the baseline measured for the first study is still fresh.
    got = lease(api, "w1")
    assert got is not None and got["kind"] == "trial"
    assert key_of(got["config"]) == key_of(shown["winner"]["config"])
    trials_b = api.get("/v1/studies/levels-b/trials", "user").json()
    assert trials_b[0]["number"] == got["trial_number"]


def test_a_different_model_gets_no_warm_start_from_another_study(api: Api) -> None:
    a = small_spec("model-a", budget={"max_trials": 3}, warm_start=[{"num_steps": 2, "topk": 2, "num_draft_tokens": 3}])
    a["confirmation"] = {"top": 0}
    api.post("/v1/studies", "user", a)
    drive(api, "model-a", ["w1"], "moe-pcie")
    b = small_spec("model-b", budget={"max_trials": 3})
    b["model"] = {"target": "moe-pcie", "draft": "moe-pcie-eagle3", "tp_size": 8}
    api.post("/v1/studies", "user", b)
    # A host with the 8 GPUs tp_size 8 needs (a worker with fewer is not offered the study).
    eight = INVENTORY | {"gpus": [{"index": i, "name": "NVIDIA H200", "memory_mib": 143771} for i in range(8)]}
    handed = drive(api, "model-b", ["w1"], "moe-pcie", inventory=eight)
    first_trial = next(le for le in handed if le["kind"] == "trial")
    # SGLang's default comes first: the other study's answer was for another tp size.
    assert key_of(first_trial["config"]) == "s3-k1-n4-bsauto"
