"""How one SGLang server is launched, as typed values: what a lease carries to a worker.

The command line built from them, per SGLang version, is optimizer.sglang's (the worker's
launcher and the API's printed command use it); the rules of the adaptive mode are there too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from spectune_protocol.speculative import MAX_STEPS, SpecConfig

# Every field is bounded as the study spec bounds it (optimizer.spec): these settings travel to
# workers, which must not trust the API (SECURITY.md), so a lease cannot carry a value that no
# spec could have produced, nor text that could forge a log line.  Names and words are only
# held to "plain text" here: the worker refuses paths, unknown models and option-like words itself,
# with a message that names the problem (workers/agent.py: server_settings_refusal).
# Patterns run in pydantic-core, where `$` is the end of the text.
_Text = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x1f\x7f]{1,256}$")]
_FlagName = Annotated[str, StringConstraints(pattern=r"^--[a-z0-9][a-z0-9-]{0,62}$")]
_GraphBs = Annotated[int, Field(ge=1, le=4096)]

# The batch sizes an adaptive config may name (SGLang's `--speculative-adaptive-config` slots).
MAX_ADAPTIVE_SLOTS = 64


class AdaptiveSteps(BaseModel):
    """An adaptive deployment as typed data: the steps SGLang runs at each batch size.

    One candidate per batch size (what a study measured there), so the server never switches
    between candidates at run time.  It travels in a lease as numbers only; the worker writes
    SGLang's JSON file from it itself (`config_doc`), never text or a path from the API.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps_by_batch: dict[_GraphBs, Annotated[int, Field(strict=True, ge=0, le=MAX_STEPS)]] = Field(
        min_length=1, max_length=MAX_ADAPTIVE_SLOTS
    )

    @model_validator(mode="after")
    def _some_slot_speculates(self) -> AdaptiveSteps:
        if not any(self.steps_by_batch.values()):
            raise ValueError("an adaptive config with steps 0 at every batch size is a server without speculation")
        return self

    def config_doc(self) -> dict[str, dict[str, list[int]]]:
        """SGLang's config file content, batch sizes in numeric order."""
        return {str(bs): {"candidate_steps": [self.steps_by_batch[bs]]} for bs in sorted(self.steps_by_batch)}

    def config_text(self) -> str:
        return json.dumps(self.config_doc())

    def steps_at(self, batch: int) -> int:
        """The steps SGLang's slot routing gives a (padded) batch of this size."""
        keys = sorted(self.steps_by_batch)
        below = [k for k in keys if k <= batch]
        return self.steps_by_batch[below[-1] if below else keys[0]]

    @classmethod
    def from_config(cls, doc: Mapping[str, Any]) -> AdaptiveSteps:
        """From a config of single-candidate slots (optimizer.answer.adaptive_export)."""
        return cls(steps_by_batch={int(k): int(v["candidate_steps"][0]) for k, v in doc.items() if k.isdigit()})


class ServerSettings(BaseModel):
    """Everything that decides how one SGLang server is launched, as typed values.

    `target` and `draft` are registry names; the worker maps them to local paths.  `speculative`
    is None for a baseline (the same server without speculation).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    target: _Text
    draft: _Text | None = None
    algorithm: Literal["EAGLE3"] = "EAGLE3"
    tp_size: int = Field(default=1, ge=1, le=64)
    attention_backend: _Text = "fa3"
    page_size: int = Field(default=1, ge=1, le=1024)
    mem_fraction_static: float | None = Field(default=None, gt=0.0, lt=1.0)
    context_length: int | None = Field(default=None, ge=128, le=10_000_000)
    # Always passed: with speculation on and the flag absent SGLang silently caps it at 48.
    max_running_requests: int = Field(ge=1, le=100_000)
    # Largest captured decode batch; or an explicit capture list (it wins when both are set).
    cuda_graph_max_bs: _GraphBs | None = None
    cuda_graph_bs: tuple[_GraphBs, ...] | None = Field(default=None, max_length=64)
    speculative: SpecConfig | None = None
    extra_args: dict[_FlagName, _Text | int | float | bool] = Field(default_factory=dict, max_length=32)
    # SGLang's adaptive mode (None: static speculation).  Left out of the serialised form when
    # None, so every stored key and lease of a static server is what it was before the field.
    # (exclude_if rather than a wrapping serializer: that one erased the field types from OpenAPI.)
    adaptive: AdaptiveSteps | None = Field(default=None, exclude_if=lambda v: v is None)

    @model_validator(mode="after")
    def _adaptive_is_a_chain(self) -> ServerSettings:
        if self.adaptive is None:
            return self
        spec = self.speculative
        if spec is None or spec.topk != 1:
            raise ValueError("an adaptive server needs speculation with topk 1 (SGLang's adaptive mode runs chains)")
        if spec.num_steps not in set(self.adaptive.steps_by_batch.values()):
            raise ValueError(
                f"speculative num_steps {spec.num_steps} must be one of the adaptive config's steps "
                f"{sorted(set(self.adaptive.steps_by_batch.values()))} (SGLang refuses to start otherwise)"
            )
        return self

    def baseline(self) -> ServerSettings:
        """The same server without speculation: the reference every speedup is measured against."""
        return self.model_copy(update={"speculative": None, "draft": None, "adaptive": None})
