"""From a study spec and a configuration to the exact server a worker launches."""

from __future__ import annotations

import hashlib
import json

from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec


def server_settings(spec: StudySpec, config: SpecConfig | None) -> ServerSettings:
    """The server for a trial (`config`) or for the baseline (`None`).

    CUDA graphs are captured up to the largest benchmarked concurrency, unless the study tunes
    the graph size; max running requests is always set, at least that concurrency, because SGLang
    silently caps it at 48 with speculation otherwise (reference/sglang.md §2 rule 7).
    """
    m = spec.model
    top = max(spec.workload.concurrency)
    graph_bs = config.cuda_graph_max_bs if config is not None and config.cuda_graph_max_bs is not None else top
    return ServerSettings(
        target=m.target,
        draft=m.draft if config is not None else None,
        algorithm=m.algorithm,
        tp_size=m.tp_size,
        attention_backend=m.attention_backend,
        page_size=m.page_size,
        mem_fraction_static=m.mem_fraction_static,
        context_length=m.context_length,
        max_running_requests=max(top, graph_bs),
        cuda_graph_max_bs=graph_bs,
        speculative=None if config is None else config.canonical(),
        extra_args=dict(m.extra_args),
    )


def baseline_key(spec: StudySpec) -> str:
    """Studies with the same baseline server and workload share baselines measured on a host."""
    doc = {
        "server": server_settings(spec, None).model_dump(mode="json"),
        "workload": spec.workload.model_dump(mode="json"),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]
