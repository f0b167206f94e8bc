"""SGLang's launch flags and resolution rules, per emulated version.

The parser is a plain `argparse.ArgumentParser` with abbreviations allowed, like SGLang's
(`srt/server_args.py::prepare_server_args`), so a wrong CUDA-graph flag name fails exactly as it
does there: on >= 0.5.20 `--cuda-graph-max-bs` is an ambiguous prefix of `-decode`/`-prefill` and
argparse exits with status 2 (docs/sglang.md §1).

`resolve()` applies `_handle_eagle_family` and the attention-backend checks of docs/sglang.md §2 and
raises the same kinds of exceptions SGLang raises (AssertionError, TypeError, ValueError), which
the server lets surface as a traceback and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from spectune_sim.landscapes import Landscape
from spectune_sim.model import SPEC_DEFAULT_MAX_RUNNING_REQUESTS, default_cuda_graph_max_bs
from spectune_sim.rules import AdaptivePlan, GraphFlags, adaptive_slots, graph_flags, has_adaptive

ATTENTION_BACKENDS = (
    "fa3",
    "fa4",
    "flashinfer",
    "triton",
    "torch_native",
    "flex_attention",
    "trtllm_mha",
    "trtllm_mla",
    "flashmla",
    "cutlass_mla",
    "aiter",
    "wave",
)
TREE_PAGED_BACKENDS = ("flashinfer", "fa3", "triton")
SPEC_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
GRAPH_BACKENDS = ("full", "breakable", "disabled")


def build_parser(version: str) -> argparse.ArgumentParser:
    """The launch parser of SGLang `version` (only the flags a tuning run touches, plus common ones)."""
    flags = graph_flags(version)
    p = argparse.ArgumentParser(prog="python -m sglang.launch_server", allow_abbrev=True)
    add = p.add_argument
    add("--model-path", "--model", dest="model_path", type=str, required=True)
    add("--tokenizer-path", type=str, default=None)
    add("--host", type=str, default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=None)
    add("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    add("--ep-size", "--expert-parallel-size", dest="ep_size", type=int, default=1)
    add("--pp-size", type=int, default=1)
    add("--nnodes", type=int, default=1)
    add("--node-rank", type=int, default=0)
    add("--dist-init-addr", type=str, default=None)
    add("--base-gpu-id", type=int, default=0)
    add("--device", type=str, default=None)
    add("--attention-backend", type=str, choices=ATTENTION_BACKENDS, default=None)
    add("--prefill-attention-backend", type=str, choices=ATTENTION_BACKENDS, default=None)
    add("--decode-attention-backend", type=str, choices=ATTENTION_BACKENDS, default=None)
    add("--sampling-backend", type=str, default=None)
    add("--moe-runner-backend", type=str, default="auto")
    add("--page-size", type=int, default=None)
    add("--max-running-requests", type=int, default=None)
    add("--max-total-tokens", type=int, default=None)
    add("--max-prefill-tokens", type=int, default=16384)
    add("--chunked-prefill-size", type=int, default=None)
    add("--schedule-policy", type=str, default="fcfs")
    add("--schedule-conservativeness", type=float, default=1.0)
    add("--mem-fraction-static", type=float, default=None)
    add("--context-length", type=int, default=None)
    # SGLang's own choices: a study's bogus value dies in argparse (exit 2), as it does on a GPU host.
    add("--dtype", type=str, default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    add("--kv-cache-dtype", type=str, default="auto")
    add("--quantization", type=str, default=None)
    add("--load-format", type=str, default="auto")
    add("--trust-remote-code", action="store_true")
    add("--served-model-name", type=str, default=None)
    add("--random-seed", type=int, default=None)
    add("--log-level", type=str, default="info")
    add("--log-requests", action="store_true")
    add("--decode-log-interval", type=int, default=40)
    add("--enable-metrics", action="store_true")
    add("--api-key", type=str, default=None)
    add("--stream-interval", type=int, default=1)
    add("--incremental-streaming-output", action="store_true")
    add("--stream-response-default-include-usage", action="store_true")
    add("--skip-server-warmup", action="store_true")
    add("--watchdog-timeout", type=float, default=300.0)
    add("--disable-radix-cache", action="store_true")
    add("--disable-overlap-schedule", action="store_true")
    add("--enable-dp-attention", action="store_true")
    add("--enable-torch-compile", action="store_true")
    add("--skip-tokenizer-init", action="store_true")
    # Speculative decoding (`srt/arg_groups/fields/spec.py`).
    add("--speculative-algorithm", type=str, choices=SPEC_ALGORITHMS, default=None)
    add(
        "--speculative-draft-model-path", "--speculative-draft-model", dest="speculative_draft_model_path", default=None
    )
    add("--speculative-draft-model-revision", type=str, default=None)
    add("--speculative-num-steps", type=int, default=None)
    add("--speculative-eagle-topk", type=int, default=None)
    add("--speculative-num-draft-tokens", type=int, default=None)
    add("--speculative-accept-threshold-single", type=float, default=1.0)
    add("--speculative-accept-threshold-acc", type=float, default=1.0)
    add("--speculative-token-map", type=str, default=None)
    add("--speculative-attention-mode", type=str, choices=("prefill", "decode"), default="prefill")
    if has_adaptive(version):
        add("--speculative-adaptive", action="store_true")
        add("--speculative-adaptive-config", type=str, default=None)
    # CUDA graphs: the names changed in 0.5.16 and the old ones went away in 0.5.20.
    add("--disable-cuda-graph", action="store_true")
    add("--disable-cuda-graph-padding", action="store_true")
    add("--enable-cudagraph-gc", action="store_true")
    if flags is GraphFlags.LEGACY:
        add("--cuda-graph-max-bs", dest="cuda_graph_max_bs", type=int, default=None)
        add("--cuda-graph-bs", dest="cuda_graph_bs", type=int, nargs="+", default=None)
    else:
        max_names = ["--cuda-graph-max-bs-decode"] + (["--cuda-graph-max-bs"] if flags is GraphFlags.ALIASED else [])
        list_names = ["--cuda-graph-bs-decode"] + (["--cuda-graph-bs"] if flags is GraphFlags.ALIASED else [])
        add(*max_names, dest="cuda_graph_max_bs", type=int, default=None)
        add(*list_names, dest="cuda_graph_bs", type=int, nargs="+", default=None)
        add("--cuda-graph-max-bs-prefill", type=int, default=None)
        add("--cuda-graph-bs-prefill", type=int, nargs="+", default=None)
    if flags is GraphFlags.DECODE_ONLY:
        add("--cuda-graph-backend-decode", choices=GRAPH_BACKENDS, default="full")
        add("--cuda-graph-backend-prefill", choices=GRAPH_BACKENDS, default="breakable")
        add("--cuda-graph-config", type=str, default=None)
    return p


@dataclass(frozen=True)
class ResolvedArgs:
    """The server's effective settings after SGLang's resolution, plus the warnings it logged."""

    values: dict[str, Any]  # every argparse dest, resolved (what /server_info reports)
    speculative: bool
    num_steps: int | None
    topk: int | None
    num_draft_tokens: int | None
    max_running_requests: int
    cuda_graph_max_bs: int
    cuda_graph_bs: tuple[int, ...] | None
    disable_cuda_graph: bool
    attention_backend: str
    page_size: int
    draft_mismatch: bool  # `--speculative-algorithm EAGLE` with an EAGLE-3 draft: AL is exactly 1
    warnings: tuple[str, ...] = field(default_factory=tuple)
    # `--speculative-adaptive` in effect: the steps per batch-size slot (rules.AdaptivePlan).
    adaptive: AdaptivePlan | None = None


def _resolve_adaptive(v: dict[str, Any], version: str, warnings: list[str]) -> AdaptivePlan | None:
    """SGLang's adaptive-mode resolution (rules.py states it); edits `v` as SGLang does."""
    if not v.get("speculative_adaptive"):
        return None
    why = None
    if v["speculative_algorithm"] not in ("EAGLE", "EAGLE3"):
        why = f"speculative_algorithm={v['speculative_algorithm']} (only EAGLE/EAGLE3 are supported)"
    elif v["speculative_eagle_topk"] is not None and v["speculative_eagle_topk"] != 1:
        why = f"speculative_eagle_topk={v['speculative_eagle_topk']} (only topk=1 is supported)"
    elif v["enable_dp_attention"]:
        why = "attention DP is not supported (adaptive tier decisions are not synchronized across DP ranks)"
    if why is not None:
        warnings.append(f"speculative_adaptive disabled: {why}. Falling back to static speculative params.")
        v["speculative_adaptive"] = False
        return None
    path = v["speculative_adaptive_config"]
    if path is None:
        raise ValueError(
            "the simulator needs --speculative-adaptive-config (SGLang's built-in default is not modelled)"
        )
    with open(path, encoding="utf-8") as f:  # a missing file fails as SGLang's open() does
        slots = adaptive_slots(json.load(f), version)
    union = sorted({s for cands in slots.values() for s in cands})
    if v["speculative_eagle_topk"] is None:
        v["speculative_eagle_topk"] = 1
    if v["speculative_num_steps"] is None:
        v["speculative_num_steps"] = union[len(union) // 2]
    if v["speculative_num_steps"] not in union:
        raise ValueError(
            f"--speculative-num-steps={v['speculative_num_steps']} is not in the adaptive config candidate_steps "
            f"{union}. Pass one of those values."
        )
    v["speculative_num_draft_tokens"] = v["speculative_num_steps"] + 1
    return AdaptivePlan.start(slots, v["speculative_num_steps"])


def resolve(ns: argparse.Namespace, landscape: Landscape, version: str) -> ResolvedArgs:
    """Apply SGLang's resolution rules (docs/sglang.md §2-3); raise what SGLang raises."""
    v = dict(vars(ns))
    warnings: list[str] = []
    algo = v["speculative_algorithm"]
    spec = algo is not None
    if spec:
        if v["speculative_draft_model_path"] is None and algo in ("EAGLE", "EAGLE3", "STANDALONE"):
            raise ValueError(
                f"--speculative-algorithm {algo} needs --speculative-draft-model-path (the draft model's weights)"
            )
        if algo == "NGRAM":
            raise ValueError("the simulator models EAGLE-family drafts only; NGRAM speculation is not simulated")
        adaptive = _resolve_adaptive(v, version, warnings)
        if adaptive is None and v["speculative_num_steps"] is None:
            # SGLang asserts the other two are unset as well, then applies per-architecture defaults.
            assert v["speculative_eagle_topk"] is None and v["speculative_num_draft_tokens"] is None, (
                "speculative_eagle_topk and speculative_num_draft_tokens should be None "
                "when speculative_num_steps is None"
            )
            steps, topk, ndt = (5, 4, 8) if landscape.llama_like else (3, 1, 4)
            v["speculative_num_steps"], v["speculative_eagle_topk"], v["speculative_num_draft_tokens"] = (
                steps,
                topk,
                ndt,
            )
        # Steps given but topk left out: SGLang compares None with 1 later on and crashes.
        topk = v["speculative_eagle_topk"]
        if topk > 1 and v["speculative_num_draft_tokens"] is None:  # the same crash, one check later
            raise TypeError("unsupported operand type(s) for -: 'NoneType' and 'int'")
        if topk == 1 and v["speculative_num_draft_tokens"] != v["speculative_num_steps"] + 1:
            warnings.append(
                "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when speculative_eagle_topk == 1"
            )
            v["speculative_num_draft_tokens"] = v["speculative_num_steps"] + 1
        if v["max_running_requests"] is None:
            v["max_running_requests"] = SPEC_DEFAULT_MAX_RUNNING_REQUESTS
            warnings.append(
                f"Max running requests is reset to {SPEC_DEFAULT_MAX_RUNNING_REQUESTS} for speculative decoding. "
                "You can override this by explicitly setting --max-running-requests."
            )
    if v["tp_size"] is None:
        v["tp_size"] = landscape.tp_size
    elif v["tp_size"] != landscape.tp_size:
        logging.getLogger("sglang").warning(
            "simulated landscape %s is modelled at tp_size=%d; --tp-size %d only changes what /server_info reports",
            landscape.name,
            landscape.tp_size,
            v["tp_size"],
        )
    page_size = v["page_size"] if v["page_size"] is not None else 1
    v["page_size"] = page_size
    backend = v["attention_backend"]
    topk_now = v["speculative_eagle_topk"] if spec else None
    if backend is None:
        # Hopper default: fa3 for MLA; for MHA fa3 only without spec or topk 1 with page size 1.
        if landscape.attention == "mla" or topk_now is None or (topk_now == 1 and page_size == 1):
            backend = "fa3"
        else:
            backend = "flashinfer"
        v["attention_backend"] = backend
    if spec and topk_now is not None and topk_now > 1:
        if backend == "trtllm_mha":
            raise ValueError("trtllm_mha backend only supports topk = 1 for speculative decoding.")
        if page_size > 1 and backend not in TREE_PAGED_BACKENDS:
            raise ValueError(
                f"speculative_eagle_topk > 1 with page_size > 1 is only supported by the "
                f"{', '.join(TREE_PAGED_BACKENDS)} attention backends, not {backend!r}."
            )
    if v["max_running_requests"] is None:
        v["max_running_requests"] = landscape.max_running_requests_default
    if v["context_length"] is None:
        v["context_length"] = landscape.context_length
    if v["mem_fraction_static"] is None:
        v["mem_fraction_static"] = landscape.mem_fraction_default
    if v["served_model_name"] is None:
        v["served_model_name"] = v["model_path"]
    if v["tokenizer_path"] is None:
        v["tokenizer_path"] = v["model_path"]
    if v["chunked_prefill_size"] is None:
        v["chunked_prefill_size"] = 8192
    disable_graph = bool(v["disable_cuda_graph"]) or v.get("cuda_graph_backend_decode") == "disabled"
    if v["disable_cuda_graph"] and graph_flags(version) is GraphFlags.DECODE_ONLY:
        warnings.append("--disable-cuda-graph is deprecated; use --cuda-graph-backend-decode disabled")
    bs_list = tuple(v["cuda_graph_bs"]) if v["cuda_graph_bs"] else None
    if bs_list:
        max_bs = max(bs_list)
    elif v["cuda_graph_max_bs"] is not None:
        max_bs = v["cuda_graph_max_bs"]
    else:
        max_bs = min(default_cuda_graph_max_bs(landscape.gpu_memory_gb, v["tp_size"]), v["max_running_requests"])
    v["cuda_graph_max_bs"] = max_bs
    if graph_flags(version) is not GraphFlags.LEGACY:
        v["cuda_graph_max_bs_decode"] = max_bs
        v["cuda_graph_bs_decode"] = v["cuda_graph_bs"]
    return ResolvedArgs(
        adaptive=adaptive if spec else None,
        values=v,
        speculative=spec,
        num_steps=v["speculative_num_steps"] if spec else None,
        topk=v["speculative_eagle_topk"] if spec else None,
        num_draft_tokens=v["speculative_num_draft_tokens"] if spec else None,
        max_running_requests=int(v["max_running_requests"]),
        cuda_graph_max_bs=int(max_bs),
        cuda_graph_bs=bs_list,
        disable_cuda_graph=disable_graph,
        attention_backend=backend,
        page_size=page_size,
        draft_mismatch=algo == "EAGLE",
        warnings=tuple(warnings),
    )
