"""From a study spec and a configuration to the exact server a worker launches."""

from __future__ import annotations

import hashlib
import json

from optimizer.objective import slo_of
from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec, Workload


def server_settings(spec: StudySpec, config: SpecConfig | None) -> ServerSettings:
    """The server a worker launches for a trial (`config`) or for the baseline (`None`).

    CUDA graphs are captured only for the batch sizes the workload runs (an explicit
    `cuda_graph_bs` list of its concurrency levels): capture dominates start-up (one graph per
    size, ~23 sizes up to 48; docs/sglang.md "CUDA graphs"), and sizes no level pads to buy
    nothing.  Baseline and trials share that list, so speedups compare like with like.  When the
    study tunes the graph size, the tuned maximum is used instead.  Max running requests is always
    set, at least the largest level, because SGLang silently caps it at 48 with speculation
    otherwise (docs/sglang.md "Resolution rules"); with a `serving` section it is the production
    value, so the KV pool measured is the one deployed.  The production server is
    `optimizer.deploy.deployment_settings`.
    """
    m = spec.model
    top = max(spec.workload.concurrency)
    tuned = config is not None and config.cuda_graph_max_bs is not None
    graph_bs = config.cuda_graph_max_bs if config is not None and config.cuda_graph_max_bs is not None else top
    graph_list = None if tuned else tuple(spec.workload.concurrency)
    running = max(top, graph_bs)
    if spec.serving is not None:
        running = max(running, spec.serving.max_running_requests)
    return ServerSettings(
        target=m.target,
        draft=m.draft if config is not None else None,
        algorithm=m.algorithm,
        tp_size=m.tp_size,
        attention_backend=m.attention_backend,
        page_size=m.page_size,
        mem_fraction_static=m.mem_fraction_static,
        context_length=m.context_length,
        max_running_requests=running,
        cuda_graph_max_bs=graph_bs,
        cuda_graph_bs=graph_list,
        speculative=None if config is None else config.canonical(),
        extra_args=dict(m.extra_args),
    )


# Workload fields added after studies were stored: left out of the key at these values, so a
# study stored before them keeps its key (and its hosts' baselines) across the upgrade.
_LATER_WORKLOAD_DEFAULTS: dict[str, object] = {
    "output_len_source": "fixed",
    "output_len_min": None,
    "input_len": None,
    "input_len_min": None,
    "request_rate": None,
}


def workload_doc(workload: Workload) -> dict[str, object]:
    """The workload as JSON, without the later fields where they hold their defaults: the form
    baseline keys hash and leases carry, so a worker that predates those fields (its Workload
    forbids unknown keys) still reads every lease that does not use them."""
    doc = workload.model_dump(mode="json")
    for name, default in _LATER_WORKLOAD_DEFAULTS.items():
        if doc.get(name, default) == default:
            doc.pop(name, None)
    return doc


def baseline_key(spec: StudySpec) -> str:
    """Studies with the same baseline server and workload share baselines measured on a host."""
    doc = {
        "server": server_settings(spec, None).model_dump(mode="json"),
        "workload": workload_doc(spec.workload),
    }
    slo = slo_of(spec.objective)
    if slo is not None:
        # A goodput baseline counts the requests meeting this SLO: shared only with the same SLO.
        doc["slo"] = slo
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]
