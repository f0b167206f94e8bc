"""The requests a workload sends: prompts, their output lengths and, in open loop, their arrival times.

Everything here is drawn from fixed seeds, so the baseline and every trial of a study send the
same requests in the same order at the same moments (only the server differs), and a level's
passes repeat one schedule.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from optimizer.spec import Workload
from workers.loadgen.prompts import CHARS_PER_TOKEN, DatasetRecord, load_dataset

_SEED = "spectune-workload"


@dataclass(frozen=True)
class RequestPlan:
    """Request i sends prompts[i % n] for output_lens[i % n] tokens."""

    prompts: list[str]
    output_lens: list[int]

    def __post_init__(self) -> None:
        if not self.prompts or len(self.prompts) != len(self.output_lens):
            raise ValueError("a request plan needs one output length per prompt, and at least one prompt")


def plan_requests(workload: Workload, records: Sequence[DatasetRecord]) -> RequestPlan:
    """Apply the workload's input and output length rules to the loaded records."""
    rng = random.Random(f"{_SEED}/lengths")
    prompts: list[str] = []
    lens: list[int] = []
    for r in records:
        prompt = r.prompt
        if workload.input_len is not None:
            low = workload.input_len_min or workload.input_len
            prompt = resize(prompt, rng.randint(low, workload.input_len) * CHARS_PER_TOKEN)
        prompts.append(prompt)
        if workload.output_len_source == "uniform":
            lens.append(rng.randint(workload.output_len_min or workload.output_len, workload.output_len))
        elif workload.output_len_source == "dataset" and r.output_len is not None:
            lens.append(r.output_len)
        else:
            lens.append(workload.output_len)
    return RequestPlan(prompts, lens)


def load_requests(workload: Workload, prompt_dir: Path | None) -> RequestPlan:
    """The workload's requests from its prompt set or dataset file (errors as `load_dataset`)."""
    return plan_requests(workload, load_dataset(workload.prompts, prompt_dir))


def resize(text: str, chars: int) -> str:
    """`text` cut or repeated to about `chars` characters (cut at a space where there is one)."""
    chars = max(1, chars)
    if len(text) < chars:
        text = " ".join([text] * (chars // max(1, len(text) + 1) + 1))
    if len(text) <= chars:
        return text
    cut = text[:chars]
    space = cut.rfind(" ")
    return cut[:space] if space > chars // 2 else cut


def arrival_offsets(rate: float, count: int, *, key: str) -> list[float]:
    """Seconds from the pass's start at which each of `count` requests arrives: a Poisson process of
    `rate` requests/s (exponential gaps), the first at 0, drawn from a seed named by `key`."""
    rng = random.Random(f"{_SEED}/arrivals/{key}")
    out: list[float] = []
    t = 0.0
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out
