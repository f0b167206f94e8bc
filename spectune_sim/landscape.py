"""What a simulated landscape is: one host + target model + EAGLE-3 draft, as the simulator's
parameters (the named ones are `spectune_sim.landscapes`, the drawn ones `spectune_sim.family`).

A module of its own so that the engine's model (`spectune_sim.model`) and the family it draws
from import the type without importing the named landscapes, whose lookup by name reaches the
family (a drawn engine is named `family-v1-0042`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class CalibrationPoint:
    """A published measurement the landscape should reproduce (batch size 1 unless stated)."""

    label: str
    num_steps: int | None  # None: the baseline (no speculation)
    topk: int
    num_draft_tokens: int
    published_tok_s: float
    source: str


@dataclass(frozen=True)
class Landscape:
    """A host + model profile.  Times are milliseconds of model time, memory GB per GPU."""

    name: str
    summary: str
    modelled_on: str
    architecture: str  # HF `architectures[0]`; decides SGLang's default spec triple
    attention: Literal["mha", "mla"]
    host: str
    gpu_memory_gb: float
    tp_size: int
    context_length: int

    # Acceptance: conditional acceptance of draft position i (1-based) given positions < i were
    # accepted; the last value repeats for deeper positions.  `tree_gain` is g of calibration §6.1
    # (relative cut of the rejection probability per doubling of the effective tree width).
    accept_by_depth: tuple[float, ...]
    tree_gain: float

    # Target forward over N tokens: F(N) = decode_ms * (1 + verify_slope*min(N-1, knee)
    #                                                  + verify_slope_after*max(0, N-1-knee)).
    # Decode at batch b costs F(b); a verify of n draft tokens at batch b costs F(b*n).
    decode_ms: float
    verify_slope: float
    verify_knee: int
    verify_slope_after: float
    # One draft step = draft_step_frac * F(b) * (1 + draft_topk_slope*(topk-1)).
    draft_step_frac: float
    draft_topk_slope: float
    overhead_ms: float
    prefill_ms_per_token: float
    # Steps of verify_tile_jump * decode_ms each time the tokens cross a multiple of verify_tile
    # (tensor-core tile padding); 0 = a smooth cost.
    verify_tile: int = 0
    verify_tile_jump: float = 0.0
    # MoE expert saturation: a share of the decode step loads expert weights, and N tokens touch
    # E(1 - (1 - a/E)^N) of the E experts (a active per token), so that share grows with the
    # experts touched and flattens once most are loaded.  0 experts = no such term.
    moe_experts: int = 0
    moe_active: int = 0
    moe_expert_share: float = 0.0
    # Rank-dependent tree efficiency: the cut of the rejection probability per doubling of the
    # tree's width, one value per doubling (1->2, 2->4, 4->8; the last repeats).  Empty: every
    # doubling cuts by `tree_gain`.
    tree_gain_by_doubling: tuple[float, ...] = ()
    # Draft cost beyond a fixed share of the decode: an interconnect latency paid by every draft
    # step (TP all-reduce of a small model), and a cost per extra drafted token (batch x (topk-1)).
    draft_step_latency_ms: float = 0.0
    draft_width_ms_per_token: float = 0.0
    # Launch-to-launch spread: each server start runs at its own speed, a lognormal factor of this
    # sd on its throughput for as long as it runs (0 = every launch alike).
    launch_sigma: float = 0.0
    # Timing noise relative to the calibrated level (spectune_sim.model.NoiseModel): 3.0 = a host
    # three times as noisy as the loadgen measurements the defaults come from.
    noise_scale: float = 1.0
    eager_penalty: float = 1.37  # calibration §5: graph off 276.3 vs on 378.6 tok/s (PR #4247)
    no_draft_extend_graph_penalty: float = 1.08  # calibration §5: +5..11% (PR #6606)

    # Memory per GPU (GB).  Static pool = mem_fraction_static * gpu_memory_gb holds weights, draft
    # and the KV pool; CUDA graphs and activations live in the rest, minus a runtime reserve.
    weights_gb: float = 16.0
    draft_gb: float = 1.0
    mem_fraction_default: float = 0.88
    runtime_reserve_gb: float = 1.0
    kv_min_gb: float = 1.0
    kv_gb_per_token: float = 0.000125
    graph_base_gb: float = 0.2
    graph_per_size_gb: float = 0.01
    graph_decode_gb_per_token: float = 0.0005
    graph_verify_gb_per_token: float = 0.0006
    graph_extend_gb_per_token: float = 0.0002
    graph_draft_gb_per_token: float = 0.0002
    max_running_requests_default: int = 1024  # without spec: SGLang derives it from the KV pool

    # Start-up (seconds of real time; SPECTUNE_SIM_TIME_SCALE shrinks them in tests).
    load_s: float = 20.0
    init_s: float = 5.0
    capture_decode_s: float = 0.1  # per captured size, no spec
    capture_verify_s: float = 0.1  # per size, target verify graph
    capture_extend_s: float = 0.08  # per size, draft extend graph
    capture_draft_step_s: float = 0.08  # per size and per draft step, draft decode graph
    capture_width_slope: float = 0.01  # relative growth of a graph's capture per extra token
    prefill_graph_s: float = 2.0
    warmup_s: float = 3.0

    calibration: tuple[CalibrationPoint, ...] = field(default_factory=tuple)

    @property
    def llama_like(self) -> bool:
        """SGLang gives (5,4,8) as the default spec triple to Llama and Grok-1, (3,1,4) to the rest."""
        return self.architecture in ("LlamaForCausalLM", "Grok1ForCausalLM")
