"""The traffic users serve, end to end: a real API, a real worker, the simulated engine.

A study on a ShareGPT-format file with its recorded output lengths; a study naming a file the
worker lacks is never offered to it (refused at its door, not after a launch); an open-loop study
at a request rate; and a code prompt set accepts longer drafts than a chat set, so the speedup
measured differs where it should.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import Cluster, cluster
from tests.support.helpers import wait_for
from tests.support.specs import small_spec

pytestmark = pytest.mark.slow

MODELS = {"moe-pcie": "moe-pcie", "moe-pcie-eagle3": "moe-pcie-eagle3"}
ONE_CONFIG = [{"num_steps": 3, "topk": 1, "num_draft_tokens": 4}]
# ShareGPT: the first human turn is the prompt, the reply's length (4 characters a token) the output.
SHAREGPT = [
    {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: explain how a hash map works, briefly."},
        {"from": "gpt", "value": "w" * (4 * (8 + 4 * i))},
    ]}
    for i in range(4)
]  # fmt: skip
RECORDED = [8 + 4 * i for i in range(4)]


def measured_once(name: str, workload: dict[str, Any]) -> dict[str, Any]:
    """A study measuring the baseline and one configuration (SGLang's default chain) on `workload`."""
    return small_spec(
        name, sampler="list", warm_start=ONE_CONFIG, budget={"max_trials": 1}, confirmation={"top": 0},
        workload={"num_prompts": 8, "concurrency": [1], "repeats": 1, "warmup_requests": 1, **workload},
    )  # fmt: skip


def finished(c: Cluster, name: str) -> dict[str, Any] | None:
    s = c.study(name)
    return s if s["state"] == "finished" else None


@pytest.fixture
def sim_cluster(tmp_path: Path, sqlite_template: Path):
    db = tmp_path / "spectune.db"
    shutil.copy(sqlite_template, db)
    (tmp_path / "run").mkdir()
    with cluster(tmp_path / "run", f"sqlite:///{db}") as c:
        c.add_worker("sim-1", MODELS, prompt_files={"sharegpt.json": json.dumps(SHAREGPT)})
        yield c


def test_a_sharegpt_study_and_a_workload_the_worker_lacks(sim_cluster: Cluster) -> None:
    c = sim_cluster
    c.create_study(measured_once("lacking", {"prompts": "missing.json"}))
    c.create_study(measured_once("sharegpt", {"prompts": "sharegpt.json", "output_len_source": "dataset"}))
    done = wait_for("the ShareGPT study to finish", lambda: finished(c, "sharegpt"), 240, interval=0.5)
    assert done["best"] is not None, c.workers[0].log_text()[-3000:]
    assert done["workload"].startswith("sharegpt.json;") and "output lengths from the dataset" in done["workload"]
    # Each request asked for its record's recorded length: 8 requests over the 4 records.
    trial = next(t for t in c.trials("sharegpt") if t["state"] == "COMPLETE")
    assert trial["levels"][0]["completion_tokens"] == 2 * sum(RECORDED)
    # The study naming a file the worker lacks was never leased to it: no launch, no refusal.
    lacking = c.study("lacking")
    assert c.leases("lacking") == [] and lacking["refused_by"] == []
    assert lacking["eligibility"]["unmet"] == ["prompts"]
    assert "no worker's prompt folder holds missing.json" in lacking["eligibility"]["warning"]


def test_an_open_loop_study_at_a_request_rate(sim_cluster: Cluster) -> None:
    c = sim_cluster
    c.create_study(measured_once("open-loop", {"request_rate": 20.0, "concurrency": [4], "num_prompts": 12}))
    done = wait_for("the open-loop study to finish", lambda: finished(c, "open-loop"), 240, interval=0.5)
    assert done["best"] is not None, c.workers[0].log_text()[-3000:]
    assert "open loop: Poisson arrivals at 20 req/s, at most 4 in flight" in done["workload"]
    trial = next(t for t in c.trials("open-loop") if t["state"] == "COMPLETE")
    assert trial["levels"][0]["num_requests"] == 12 and trial["levels"][0]["concurrency"] == 4


def test_a_code_prompt_set_accepts_longer_drafts_than_a_chat_set(sim_cluster: Cluster) -> None:
    c = sim_cluster
    for name in ("chat", "code"):
        # Long enough outputs that decoding, which speculation speeds up, dominates prefill.
        c.create_study(measured_once(f"on-{name}", {"prompts": f"builtin:{name}", "output_len": 256}))
    done = {
        name: wait_for(f"the {name} study", lambda n=name: finished(c, f"on-{n}"), 240, interval=0.5)
        for name in ("chat", "code")
    }
    trials = {name: next(t for t in c.trials(f"on-{name}") if t["state"] == "COMPLETE") for name in done}
    chat_al, code_al = (trials[n]["levels"][0]["accept_length"] for n in ("chat", "code"))
    # One configuration, one host: only what was asked differs (MT-bench 2.7 vs HumanEval 3.5).
    assert code_al > 1.1 * chat_al, (chat_al, code_al)
    # (The speedups follow on a quiet host, 1.27x against 1.31x at output_len 32 and the other way at
    # 256; on a loaded one the saturation checks may withhold them, so only accept length is asserted.)
    assert all(d["best"] is not None for d in done.values())
