"""What a study measures: the requests sent at each concurrency level (the workload a lease carries).

Describing it in words and the study spec around it are optimizer.spec's.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# A trial reports at most this many levels (spectune_protocol.Metrics), so a spec may ask for no more.
MAX_CONCURRENCY_LEVELS = 64
_BUILTIN_PROMPTS_RE = re.compile(r"builtin:[a-z0-9_-]{1,32}\Z")
_PROMPT_FILE_RE = re.compile(r"[A-Za-z0-9._-]{1,128}\Z")
# NaN and +-Infinity refused, as by every spec model (optimizer.spec).
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class Workload(BaseModel):
    model_config = _STRICT

    # "builtin:<name>" for a prompt set shipped with spectune, or a file name inside the worker's
    # configured prompt folder (never a path chosen here).
    prompts: str = Field(default="builtin:chat", max_length=128)
    output_len: int = Field(default=256, ge=1, le=32768)
    num_prompts: int = Field(default=64, ge=1, le=100_000)
    concurrency: list[int] = Field(default_factory=lambda: [1], max_length=MAX_CONCURRENCY_LEVELS)
    warmup_requests: int = Field(default=4, ge=0, le=10_000)
    repeats: int = Field(default=3, ge=1, le=100)
    # Output lengths: "fixed" (every request output_len tokens), "uniform" (each request draws
    # from output_len_min..output_len), or "dataset" (the lengths the prompt file records: an
    # explicit output_len / max_tokens, or the recorded reply's length; output_len for records
    # without one).  Drawn with a fixed seed: the baseline and every trial send the same requests.
    output_len_source: Literal["fixed", "uniform", "dataset"] = "fixed"
    output_len_min: int | None = Field(default=None, ge=1, le=32768)
    # Input lengths: None sends the prompts as they are; else each prompt is cut or repeated to a
    # length drawn from input_len_min..input_len (estimated tokens, 4 characters a token).
    input_len: int | None = Field(default=None, ge=1, le=131072)
    input_len_min: int | None = Field(default=None, ge=1, le=131072)
    # Open loop: requests arrive at this rate (req/s, Poisson arrivals with a fixed seed, as
    # `sglang.bench_serving --request-rate`), each concurrency level capping the requests in
    # flight (its --max-concurrency).  None: closed loop, `concurrency` requests always in flight.
    request_rate: float | None = Field(default=None, gt=0, le=100_000)
    # Fixed: greedy decoding and ignore_eos make every request exactly its output length long and
    # acceptance reproducible (docs/sglang.md §9).
    temperature: Literal[0] = 0
    ignore_eos: Literal[True] = True

    @model_validator(mode="after")
    def _lengths(self) -> Workload:
        if self.output_len_source == "uniform":
            low = self.output_len_min
            if low is None or low > self.output_len:
                raise ValueError(
                    "output_len_source 'uniform' needs output_len_min <= output_len (the range drawn from)"
                )
        elif self.output_len_min is not None:
            raise ValueError("output_len_min is only used with output_len_source 'uniform'")
        if self.input_len_min is not None and (self.input_len is None or self.input_len_min > self.input_len):
            raise ValueError("input_len_min needs input_len, and input_len_min <= input_len")
        return self

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("give at least one concurrency level, e.g. [1]")
        if any(c < 1 or c > 4096 for c in v) or len(set(v)) != len(v):
            raise ValueError(f"levels must be distinct integers in 1..4096, got {v}")
        return sorted(v)

    @field_validator("prompts")
    @classmethod
    def _prompts(cls, v: str) -> str:
        if v.startswith("builtin:"):
            if not _BUILTIN_PROMPTS_RE.match(v):
                raise ValueError("builtin prompt sets are named like 'builtin:chat'")
            return v
        if "/" in v or "\\" in v or v.startswith(".") or not _PROMPT_FILE_RE.match(v):
            raise ValueError(
                "prompts is 'builtin:<set>' or a plain file name inside the worker's prompt folder (no path)"
            )
        return v
