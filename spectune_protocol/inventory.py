"""What a worker tells the API about its host each time it asks for work."""

from __future__ import annotations

from pydantic import BaseModel, Field

from spectune_protocol.fields import (
    IN,
    MAX_COUNT,
    MAX_LABELS,
    MAX_MODELS,
    LabelKey,
    LabelValue,
    ModelName,
    Plain,
    PromptFile,
    Version,
    Word,
)


class GpuInfo(BaseModel):
    model_config = IN

    index: int = Field(ge=0, le=1024)
    name: Plain = Field(max_length=128)
    memory_mib: int = Field(ge=0, le=MAX_COUNT)


class Inventory(BaseModel):
    """What a worker tells the API about its host each time it asks for work."""

    model_config = IN

    hostname: Plain = Field(default="", max_length=255)
    gpus: list[GpuInfo] = Field(default_factory=list, max_length=64)
    driver_version: Word | None = None
    sglang_version: Version
    models: list[ModelName] = Field(default_factory=list, max_length=MAX_MODELS)
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=MAX_LABELS)
    spectune_version: Word | None = None
    # A digest of what decides what this worker refuses (its allowlist of server flags, its model
    # registry, its prompt files): when it changes, the API ends this worker's refusals.
    config_digest: str | None = Field(default=None, pattern=r"^[0-9a-f]{16,64}$")
    # The dataset and prompt files in the worker's prompt folder (plain file names): a study whose
    # workload names a file a worker lacks is not offered to that worker.
    prompt_files: list[PromptFile] = Field(default_factory=list, max_length=1024)
