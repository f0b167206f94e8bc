"""The traffic users serve: dataset files (ShareGPT JSON, OpenAI chat JSONL), length distributions,
open-loop arrivals at a request rate, and the simulator's acceptance following what is asked."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from optimizer.spec import Workload, describe_workload
from spectune_sim.model import accept_length, scaled_acceptance, text_reject_scale
from tests.workers.test_loadgen import FakeSGLang, fake  # noqa: F401 - the fixture
from workers.loadgen import LoadgenError, load_prompts, run_workload
from workers.loadgen.plan import arrival_offsets, load_requests, plan_requests, resize
from workers.loadgen.prompts import DatasetRecord, load_dataset

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "Tell me a story."}, {"from": "gpt", "value": "x" * 400}]},
    {"id": "b", "conversations": [{"from": "human", "value": "Only a question, no reply."}]},  # skipped
    {
        "id": "c",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Sum 2+2."},
            {"from": "gpt", "value": "4"},
            {"from": "human", "value": "and 3+3?"},
        ],
    },  # fmt: skip
]


def test_sharegpt_json_gives_the_first_human_turn_and_the_replys_length(tmp_path: Path) -> None:
    (tmp_path / "sg.json").write_text(json.dumps(SHAREGPT))
    records = load_dataset("sg.json", tmp_path)
    # As bench_serving: entries without a reply are skipped; lengths estimated at 4 chars a token.
    assert records == [DatasetRecord("Tell me a story.", 100), DatasetRecord("Sum 2+2.", 1)]


def test_openai_chat_jsonl_with_and_without_recorded_lengths(tmp_path: Path) -> None:
    lines = [
        {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}], "max_tokens": 64},
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "y" * 80}]},
        {"messages": [{"role": "user", "content": "no answer recorded"}]},
    ]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    records = load_dataset("chat.jsonl", tmp_path)
    assert records[0] == DatasetRecord("system: Be terse.\nuser: Hi", 64)
    assert records[1] == DatasetRecord("user: Q", 20)
    assert records[2] == DatasetRecord("user: no answer recorded", None)
    assert load_prompts("chat.jsonl", tmp_path)[2] == "user: no answer recorded"
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}\n')
    with pytest.raises(LoadgenError, match=r"bad.jsonl line 1: max_tokens must be an integer in 1..32768"):
        load_dataset("bad.jsonl", tmp_path)
    (tmp_path / "bad.json").write_text('[{"conversations": "nope"}]')
    with pytest.raises(LoadgenError, match='bad.json entry 1: "conversations" must be a list'):
        load_dataset("bad.json", tmp_path)


def test_output_and_input_length_rules_are_seeded_and_bounded() -> None:
    records = [DatasetRecord(f"prompt number {i}", 10 * (i + 1) if i % 2 else None) for i in range(40)]
    fixed = plan_requests(Workload(output_len=32), records)
    assert set(fixed.output_lens) == {32}
    dataset = plan_requests(Workload(output_len=32, output_len_source="dataset"), records)
    assert dataset.output_lens[:4] == [32, 20, 32, 40]
    uniform = plan_requests(Workload(output_len=64, output_len_source="uniform", output_len_min=16), records)
    assert min(uniform.output_lens) >= 16 and max(uniform.output_lens) <= 64 and len(set(uniform.output_lens)) > 5
    again = plan_requests(Workload(output_len=64, output_len_source="uniform", output_len_min=16), records)
    assert again == uniform  # the baseline and every trial send the same requests
    sized = plan_requests(Workload(input_len=50, input_len_min=25), records)
    assert all(90 <= len(p) <= 200 for p in sized.prompts), [len(p) for p in sized.prompts]
    assert resize("abc def", 3) == "abc" and len(resize("word", 40)) <= 40
    with pytest.raises(ValueError, match="output_len_min <= output_len"):
        Workload(output_len=8, output_len_source="uniform", output_len_min=9)


def test_poisson_arrivals_have_the_asked_rate_and_repeat_per_key() -> None:
    gaps = [b - a for a, b in zip(*(lambda t: (t, t[1:]))(arrival_offsets(10.0, 4001, key="k")), strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.08)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.1)
    assert arrival_offsets(10.0, 5, key="k") == arrival_offsets(10.0, 5, key="k")
    assert arrival_offsets(10.0, 5, key="k") != arrival_offsets(10.0, 5, key="other")


def test_open_loop_paces_requests_and_dataset_lengths_reach_the_server(
    fake: FakeSGLang,  # noqa: F811
    tmp_path: Path,
) -> None:
    (tmp_path / "sg.json").write_text(json.dumps(SHAREGPT))
    workload = Workload(
        prompts="sg.json", output_len_source="dataset", output_len=8, num_prompts=6, concurrency=[4],
        warmup_requests=0, repeats=1, request_rate=40.0,
    )  # fmt: skip
    plan = load_requests(workload, tmp_path)
    levels = run_workload(fake.url, workload, plan.prompts, output_lens=plan.output_lens, processes=1)
    assert levels[0].num_requests == 6
    # Request i sends record i % 2 with that record's recorded length.  On a busy machine the
    # load generator may find its first try saturated and measure the level once more, sending
    # the same six requests again (workers/loadgen/runner.py: "again: the first try was
    # saturated").  Requests in flight together may reach the server in any order, so each one is
    # checked against its own prompt, and the counts per record.
    sent = [(p, s["max_new_tokens"]) for p, s in zip(fake.state.prompts, fake.state.sampling, strict=True)]
    assert len(sent) in (6, 12), sent
    assert sorted(sent) == sorted([("Sum 2+2.", 1), ("Tell me a story.", 100)] * (len(sent) // 2)), sent
    # Open loop: the server never saw more in flight than the level's cap.
    assert 1 <= fake.state.max_in_flight <= 4
    text = describe_workload(workload)
    assert "open loop: Poisson arrivals at 40 req/s, at most 4 in flight" in text and "sg.json" in text


def test_simulated_acceptance_follows_the_prompt_set() -> None:
    chat = load_prompts("builtin:chat", None)
    code = load_prompts("builtin:code", None)
    chat_scale = statistics.mean(text_reject_scale(p) for p in chat)
    code_scale = statistics.mean(text_reject_scale(p) for p in code)
    # Chat is what the landscapes are calibrated on: (almost) unchanged.  Code: fewer rejections.
    assert chat_scale > 0.95 and code_scale < 0.8
    rates = (0.75, 0.65, 0.58, 0.5, 0.45)
    chat_al = accept_length(scaled_acceptance(rates, chat_scale))
    code_al = accept_length(scaled_acceptance(rates, code_scale))
    # Published EAGLE-3 accept lengths for one draft: MT-bench 2.7 against HumanEval 3.5.
    assert code_al / chat_al > 1.15
