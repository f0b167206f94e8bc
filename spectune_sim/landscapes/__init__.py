"""Named landscapes: one host + target model + EAGLE-3 draft each, as the simulator's parameters.

Every number is either fitted to a published measurement (docs/calibration.md, cited per
field) or a stated assumption.  `spectune_sim/README.md` explains the equations; this module
only holds values.  Run `python -m spectune_sim.landscapes` for the per-landscape table of
baselines and true optima.
"""

from __future__ import annotations

import dataclasses

from spectune_sim import family
from spectune_sim.landscape import CalibrationPoint as CalibrationPoint
from spectune_sim.landscape import Landscape as Landscape

# Large MoE over PCIe (docs/calibration.md §1, the reference case).  Fitted on the four measured rows:
# baseline 90 tok/s, steps 2/5/10 at 94/71.3/60 (topk 1).  Acceptance: the steps-10 row pins
# AL ~2.6-2.95 (accept rate 0.16-0.27); position 2 above position 1 and a decay after it (as for
# MTP-like heads, §4) is what makes steps 2 the best chain *and* steps 5 fall to ~71: with a flat
# rate the published 94 -> 71.3 drop cannot coexist with steps 1 losing to steps 2.
# Cost: draft step + verified token ~0.45 of a decode (δ=0.10, β=0.349) up to a knee of 5 tokens,
# then β'=0.066 (the "concave MoE verify" reading of §1).
MOE_PCIE = Landscape(
    name="moe-pcie",
    summary="large MLA MoE (Kimi-K2.5 class) at TP8 over PCIe; only a short chain helps",
    modelled_on="Kimi-K2.5 + EAGLE-3 draft, TP8 over PCIe (docs/calibration.md §1)",
    architecture="DeepseekV3ForCausalLM",
    attention="mla",
    host="8x 96 GB PCIe GPUs, no NVLink",
    gpu_memory_gb=96.0,
    tp_size=8,
    context_length=262144,
    accept_by_depth=(0.68, 0.72, 0.58),
    tree_gain=0.15,
    decode_ms=1000.0 / 90.0,
    verify_slope=0.349,
    verify_knee=5,
    verify_slope_after=0.066,
    draft_step_frac=0.10,
    draft_topk_slope=0.02,
    overhead_ms=2.0,
    prefill_ms_per_token=0.08,
    weights_gb=74.5,  # ~595 GB INT4 checkpoint / 8
    draft_gb=0.4,  # ~3 GB draft (large vocab head) / 8
    mem_fraction_default=0.88,
    runtime_reserve_gb=2.0,
    kv_min_gb=2.0,
    kv_gb_per_token=0.00009,  # MLA latent cache, per GPU
    graph_base_gb=0.4,
    graph_per_size_gb=0.02,
    graph_decode_gb_per_token=0.002,
    graph_verify_gb_per_token=0.0009,  # logits over a 164k vocab + MoE dispatch buffers
    graph_extend_gb_per_token=0.0003,
    graph_draft_gb_per_token=0.0003,
    max_running_requests_default=512,
    # 10-15 min per restart at many steps (§1): 300 s load + 23 sizes x (1.5 + 1.2 + 1.6 k) s.
    load_s=300.0,
    init_s=40.0,
    capture_decode_s=1.0,
    capture_verify_s=1.5,
    capture_extend_s=1.2,
    capture_draft_step_s=1.6,
    prefill_graph_s=15.0,
    warmup_s=10.0,
    calibration=(
        CalibrationPoint("no speculation", None, 1, 1, 90.0, "docs/calibration.md §1 (M)"),
        CalibrationPoint("steps 2 / ndt 3", 2, 1, 3, 94.0, "docs/calibration.md §1 (M)"),
        CalibrationPoint("steps 5 / ndt 6", 5, 1, 6, 71.3, "docs/calibration.md §1 (M)"),
        CalibrationPoint("steps 10 / ndt 11", 10, 1, 11, 60.0, "docs/calibration.md §1 (M)"),
    ),
)

# Llama-3.1-8B-Instruct on one H100 (calibration §2a, §3, §5).  Baseline 158.3 tok/s; default
# 5/4/8 ~373 tok/s (2.36x).  Per-position acceptance from vLLM's AL(k) on MT-bench (#20780:
# 2.36 2.79 3.08 3.32 3.46 3.54 for k=2..7).  F(N) is linear: 21 us per batched token on a
# 5.9 ms forward (SpecDecode-Bench fit), i.e. slope 1/280; that gives the speedup decline with
# batch size of the EAGLE-3 paper's Table 3.
DENSE_8B_H100 = Landscape(
    name="dense-8b-h100",
    summary="Llama-3.1-8B on one H100; deep chains and wide trees pay off",
    modelled_on="Llama-3.1-8B-Instruct + EAGLE-3, 1x H100 80 GB (docs/calibration.md §2a, §3)",
    architecture="LlamaForCausalLM",
    attention="mha",
    host="1x H100 80 GB SXM",
    gpu_memory_gb=80.0,
    tp_size=1,
    context_length=131072,
    accept_by_depth=(0.76, 0.79, 0.72, 0.70, 0.68, 0.62, 0.58),
    tree_gain=0.15,
    decode_ms=1000.0 / 158.3,
    verify_slope=1.0 / 280.0,
    verify_knee=0,
    verify_slope_after=1.0 / 280.0,
    draft_step_frac=0.07,
    draft_topk_slope=0.02,
    overhead_ms=1.0,
    prefill_ms_per_token=0.03,
    weights_gb=16.1,
    draft_gb=0.9,
    mem_fraction_default=0.85,
    runtime_reserve_gb=1.5,
    kv_min_gb=2.0,
    kv_gb_per_token=0.000125,  # 32 layers x 8 KV heads x 128 x 2 x bf16
    graph_base_gb=0.3,
    graph_per_size_gb=0.01,
    graph_decode_gb_per_token=0.0006,
    graph_verify_gb_per_token=0.0006,  # fp32 logits over a 128k vocab
    graph_extend_gb_per_token=0.0002,
    graph_draft_gb_per_token=0.0002,
    max_running_requests_default=2048,
    load_s=15.0,
    init_s=8.0,
    capture_decode_s=0.08,
    capture_verify_s=0.1,
    capture_extend_s=0.08,
    capture_draft_step_s=0.08,
    prefill_graph_s=3.0,
    warmup_s=5.0,  # SGLang warmup request + first health generation
    calibration=(
        CalibrationPoint("no speculation", None, 1, 1, 158.3, "EAGLE-3 paper Tab. 4 (M)"),
        CalibrationPoint("SGLang default 5/4/8", 5, 4, 8, 373.3, "EAGLE-3 paper Tab. 4 (M)"),
    ),
)

# Qwen3-30B-A3B at TP4 on H100 (calibration §2b, AngelSlim #163 / SpecForge #339): small active
# MoE, cheap decode, large fixed spec cost; every measured configuration lost to the baseline.
NO_GAIN = Landscape(
    name="no-gain",
    summary="Qwen3-30B-A3B at TP4 on H100: no speculative configuration beats the baseline",
    modelled_on="Qwen3-30B-A3B + EAGLE-3, 4x H100 TP4 (docs/calibration.md §2b)",
    architecture="Qwen3MoeForCausalLM",
    attention="mha",
    host="4x H100 80 GB, NVLink",
    gpu_memory_gb=80.0,
    tp_size=4,
    context_length=40960,
    accept_by_depth=(0.5,),  # AL 1.86 at 3/1/4 (SpecForge #339)
    tree_gain=0.15,
    decode_ms=1000.0 / 218.9,
    verify_slope=0.2,
    verify_knee=3,
    verify_slope_after=0.08,
    draft_step_frac=0.2,
    draft_topk_slope=0.02,
    overhead_ms=1.8,
    prefill_ms_per_token=0.02,
    weights_gb=15.3,
    draft_gb=0.3,
    mem_fraction_default=0.85,
    runtime_reserve_gb=1.5,
    kv_min_gb=2.0,
    kv_gb_per_token=0.000024,
    max_running_requests_default=2048,
    load_s=40.0,
    init_s=20.0,
    capture_decode_s=0.3,
    capture_verify_s=0.3,
    capture_extend_s=0.25,
    capture_draft_step_s=0.2,
    prefill_graph_s=5.0,
    warmup_s=3.0,
    calibration=(
        CalibrationPoint("no speculation", None, 1, 1, 218.9, "AngelSlim #163 (M)"),
        CalibrationPoint("3/3/4", 3, 3, 4, 170.4, "AngelSlim #163 (M)"),
        CalibrationPoint("4/4/16", 4, 4, 16, 185.6, "AngelSlim #163 (M)"),
    ),
)

# dense-8b-h100's model and draft (Llama-3.1-8B) on one slower 24 GB GPU: the weights leave ~2.4 GB outside the static pool for CUDA
# graphs, so wide verify buffers (draft tokens x captured batch) run out of memory at capture.
# The cliff follows the docs' advice order: draft tokens first, then topk/steps, then max bs.
MEM_TIGHT = dataclasses.replace(
    DENSE_8B_H100,
    name="mem-tight",
    summary="Llama-3.1-8B on one 24 GB GPU: large draft-token counts and graph batches OOM",
    modelled_on="Llama-3.1-8B-Instruct + EAGLE-3, 1x 24 GB GPU (RTX 4090 class)",
    host="1x 24 GB GPU, PCIe",
    gpu_memory_gb=24.0,
    decode_ms=1000.0 / 62.0,
    verify_slope=1.0 / 160.0,
    verify_slope_after=1.0 / 160.0,
    overhead_ms=1.5,
    prefill_ms_per_token=0.1,
    runtime_reserve_gb=1.2,
    kv_min_gb=1.5,
    graph_base_gb=0.25,
    graph_verify_gb_per_token=0.0008,
    max_running_requests_default=256,
    load_s=25.0,
    capture_decode_s=0.1,
    capture_verify_s=0.12,
    capture_extend_s=0.1,
    capture_draft_step_s=0.1,
    warmup_s=2.0,
    calibration=(),
)

# The next two are built so that spectune's own model (optimizer.perf_model) does not describe
# them: a benchmark on them measures the search against an engine it was not written for.  Both
# run on dense-8b-h100's host (GPU, memory, start-up); only the model differs.

# A dense 8B-class target whose draft head is trained unevenly: acceptance zig-zags across draft
# positions (odd positions weak, even ones strong), and the verify GEMMs pad the tokens to
# tensor-core tiles of 16, so the verify cost jumps at 17, 33, 49 tokens instead of rising
# smoothly.  Stated assumptions, not a calibration.
ZIGZAG_TILES = dataclasses.replace(
    DENSE_8B_H100,
    name="zigzag-tiles",
    summary="dense 8B on one H100; acceptance not monotone across positions, verify cost steps at 16-token tiles",
    modelled_on="assumption: an unevenly trained EAGLE-3 head on an H100 with tile-padded verify GEMMs",
    architecture="Qwen2ForCausalLM",
    context_length=32768,
    accept_by_depth=(0.62, 0.9, 0.5, 0.88, 0.45, 0.85, 0.4),
    tree_gain=0.22,
    decode_ms=1000.0 / 150.0,
    verify_slope=0.002,
    verify_slope_after=0.002,
    verify_tile=16,
    verify_tile_jump=0.22,
    draft_step_frac=0.06,
    draft_topk_slope=0.03,
    weights_gb=15.2,
    # Graph memory as first stated here (the field defaults), not dense-8b-h100's.
    graph_base_gb=0.2,
    graph_decode_gb_per_token=0.0005,
    calibration=(),
)

# A 14B-class target on one 32 GB GPU whose draft decode graphs are large (a big draft vocab
# head captured per step and per topk branch): memory runs out with steps x topk, not with the
# draft tokens, and wide trees accept well, so the optimum sits near the cliff.  Assumption.
DRAFT_MEM_CLIFF = Landscape(
    name="draft-mem-cliff",
    summary="14B on one 32 GB GPU: draft decode graphs (steps x topk) run out of memory near the optimum",
    modelled_on="assumption: a large-vocab EAGLE-3 head whose draft graphs dominate graph memory",
    architecture="Qwen3ForCausalLM",
    attention="mha",
    host="1x 32 GB GPU, PCIe",
    gpu_memory_gb=32.0,
    tp_size=1,
    context_length=32768,
    accept_by_depth=(0.8, 0.78, 0.74, 0.7, 0.66, 0.62, 0.58),
    tree_gain=0.3,
    decode_ms=1000.0 / 55.0,
    verify_slope=1.0 / 200.0,
    verify_knee=0,
    verify_slope_after=1.0 / 200.0,
    draft_step_frac=0.05,
    draft_topk_slope=0.01,
    overhead_ms=1.5,
    prefill_ms_per_token=0.1,
    weights_gb=24.5,
    draft_gb=1.2,
    mem_fraction_default=0.88,
    runtime_reserve_gb=0.9,
    kv_min_gb=1.0,
    graph_base_gb=0.2,
    graph_per_size_gb=0.01,
    graph_verify_gb_per_token=0.0015,
    graph_extend_gb_per_token=0.0005,
    graph_draft_gb_per_token=0.006,
    max_running_requests_default=256,
    load_s=30.0,
    init_s=8.0,
    capture_decode_s=0.1,
    capture_verify_s=0.12,
    capture_extend_s=0.1,
    capture_draft_step_s=0.15,
    prefill_graph_s=3.0,
    warmup_s=2.0,
)

# A dense 8B-class target with two regimes the model's smooth acceptance cannot hold at once: the
# draft is good for two positions, then fails a "hard token" at position 3 (0.25), then is good
# again.  Narrow trees that stop before the hard token (s7-k2-n8, 2.195x) form a local optimum
# 2.2% below the global one, wider trees that push through it (s8-k4-n25, 2.243x), with a valley
# between.  Stated assumptions, not a calibration.
TWO_PEAKS = dataclasses.replace(
    DENSE_8B_H100,
    name="two-peaks",
    summary="dense 8B on one H100; a hard token at draft position 3 gives a second local optimum 2% below the best",
    modelled_on="assumption: an EAGLE-3 head that stumbles on a third-position token class, H100 verify",
    architecture="Qwen2ForCausalLM",
    context_length=32768,
    accept_by_depth=(0.85, 0.8, 0.25, 0.92, 0.9, 0.88, 0.85),
    tree_gain=0.2,
    verify_slope=0.01,
    verify_slope_after=0.01,
    draft_topk_slope=0.1,
    # Graph memory as first stated here (the field defaults), not dense-8b-h100's.
    graph_base_gb=0.2,
    graph_decode_gb_per_token=0.0005,
    calibration=(),
)

# dense-8b-h100's engine on a host three times as noisy (shared node, power capping, a busy
# network path to the load generator): the surface is the calibrated one, the measurements are not.
NOISY_8B = dataclasses.replace(
    DENSE_8B_H100,
    name="noisy-8b",
    summary="dense-8b-h100's engine with three times the calibrated timing noise",
    modelled_on="dense-8b-h100 on a shared, power-capped host (assumption: noise x3)",
    noise_scale=3.0,
    calibration=(),
)

# mem-tight's engine with less room outside the static pool (a bigger runtime reserve: another
# process, a larger activation workspace): the tuning envelope (graphs for the measured batch
# sizes only) fits every configuration, the deployed one (graphs up to 48 running requests) only
# the smallest, as in issue 17's 14B-on-48 GB case.  Graphs up to 16 fit again.
DEPLOY_TIGHT = dataclasses.replace(
    MEM_TIGHT,
    name="deploy-tight",
    summary="mem-tight with 1.1 GB for CUDA graphs: tuning fits, graphs up to 48 do not",
    modelled_on="mem-tight with a 2.5 GB runtime reserve (assumption)",
    runtime_reserve_gb=2.5,
    calibration=(),
)

# moe-pcie's host with a draft that is often right and a verify that turns compute-bound past a
# few tokens (assumption): speculation pays 1.8x alone and loses from 4 running requests on, so
# no single configuration pays over both, and SGLang's adaptive mode (drafting at batch 1, steps
# 0 from 4) is the answer (issue 17 item 3).
SPLIT_LOAD = dataclasses.replace(
    MOE_PCIE,
    name="split-load",
    summary="moe-pcie with a compute-bound verify: 1.8x alone, every configuration loses from 4 requests on",
    modelled_on="moe-pcie with accept 0.8..0.55 per depth and a verify knee at 3 tokens (assumption)",
    accept_by_depth=(0.8, 0.75, 0.7, 0.65, 0.6, 0.55),
    verify_slope=0.02,
    verify_knee=3,
    verify_slope_after=0.6,
    calibration=(),
)

LANDSCAPES: dict[str, Landscape] = {
    ls.name: ls
    for ls in (
        MOE_PCIE,
        DENSE_8B_H100,
        NO_GAIN,
        MEM_TIGHT,
        ZIGZAG_TILES,
        DRAFT_MEM_CLIFF,
        TWO_PEAKS,
        NOISY_8B,
        DEPLOY_TIGHT,
        SPLIT_LOAD,
    )  # fmt: skip
}


class UnknownLandscapeError(KeyError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return (
            f"no simulated landscape named {self.name!r}; the last component of --model-path names it, "
            f"e.g. /models/moe-pcie.  Known: {', '.join(sorted(LANDSCAPES))}, and drawn engines "
            "family-v1-0000, family-v1-0001, ... (spectune_sim.family)"
        )


def get_landscape(name: str) -> Landscape:
    """The landscape called `name` (also accepts a model path whose last component is the name),
    or a drawn engine of `spectune_sim.family` by its name (`family-v1-0042`)."""
    key = name.rstrip("/").rsplit("/", 1)[-1]
    try:
        return LANDSCAPES[key]
    except KeyError:
        pass
    drawn = family.parse_name(key)
    if drawn is None:
        raise UnknownLandscapeError(key)
    try:
        return family.engine(drawn[1], drawn[0]).landscape
    except family.FamilyError:
        raise UnknownLandscapeError(key) from None
