"""Study specs and a worker inventory that tests start from and change what they test."""

from __future__ import annotations

from typing import Any


def small_spec(name: str = "s1", **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "model": {"target": "moe-pcie", "draft": "moe-pcie-eagle3"},
        "search_space": {
            "num_steps": {"low": 1, "high": 6},
            "topk": [1, 2, 4],
            "num_draft_tokens": {"low": 2, "high": 16},
        },
        "workload": {"output_len": 32, "num_prompts": 4, "concurrency": [1], "repeats": 1, "warmup_requests": 1},
        "budget": {"max_trials": 8},
        "seed": 7,
    }
    spec.update(overrides)
    return spec


def split_load_spec(name: str, *, output_len: int) -> dict[str, Any]:
    """A study on split-load (speculation pays alone and loses from 4 requests on, so the answer
    is SGLang's adaptive mode) over two chains: the search is over in two launches."""
    return small_spec(
        name,
        model={"target": "split-load", "draft": "split-load-eagle3"},
        search_space={"num_steps": {"low": 1, "high": 2}, "topk": [1]},
        workload={
            "output_len": output_len, "num_prompts": 4, "concurrency": [1, 4], "warmup_requests": 1, "repeats": 2,
        },
        budget={"max_trials": 2, "converge": False},
        confirmation={"top": 1},
        seed=11,
    )  # fmt: skip


def set_path(doc: dict[str, Any], path: str, value: Any, sep: str = ".") -> dict[str, Any]:
    """`doc` with `value` at the nested key `path` ("budget.max_trials"), tables made as needed."""
    node = doc
    *parents, last = path.split(sep)
    for k in parents:
        node = node.setdefault(k, {})
    node[last] = value
    return doc


INVENTORY: dict[str, Any] = {
    "hostname": "gpu-host",
    "sglang_version": "0.5.23",
    "models": ["moe-pcie", "moe-pcie-eagle3"],
    "gpus": [{"index": 0, "name": "NVIDIA H200", "memory_mib": 143771}],
    "labels": {"gpu": "h200"},
}
