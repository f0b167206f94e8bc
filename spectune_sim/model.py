"""The simulator's performance model: pure functions of a landscape and a configuration.

No I/O, no clocks, no global state: everything here is deterministic and fast (a prediction is a
few microseconds), so benchmarks of search strategies can call it thousands of times.  The
server (`spectune_sim.engine`) uses the same functions to pace its scheduler.

Equations (README.md has the derivation and the calibration):

* acceptance per depth i: a_i from the landscape; a tree of topk t and n draft tokens has depth
  d = min(k, n-1) and effective width w = min(t, 1 + (n-1)/d), and each depth's rejection
  probability is cut by (1-g)^log2(w): a_i' = 1 - (1-a_i)(1-g)^log2(w);
  AL = 1 + sum_{j<=d} prod_{i<=j} a_i'.
* target forward over N tokens F(N) = t0 (1 + beta min(N-1, x_k) + beta' max(0, N-1-x_k));
  decode t_dec(b) = F(b), verify t_v(b, n) = F(b n), draft step t_d = delta F(b)(1 + gamma(t-1)).
* an extend of b requests by k uncached tokens each (a cached prefix) is one forward F(b k).
* cycle T(b) = k t_d + t_v + t_o at the padded batch size, times 1.37 when eager.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal, Protocol, TypedDict, TypeVar, Unpack

from spectune_sim.landscape import Landscape
from spectune_sim.rules import AdaptivePlan, DraftLike, DraftTree, draft_token_limit

C = TypeVar("C", bound=DraftLike)
C_co = TypeVar("C_co", bound=DraftLike, covariant=True)


class ConfigSpace(Protocol[C_co]):
    """Anything that lists configurations (the tuner's SearchSpace, or `rules.TreeGrid`)."""

    def iter_configs(self) -> Iterable[C_co]: ...


# SGLang's default max running requests with speculation on and the flag absent (docs/sglang.md §2.7).
SPEC_DEFAULT_MAX_RUNNING_REQUESTS = 48


class InfeasibleConfigError(ValueError):
    """num_draft_tokens - 1 > topk + (num_steps - 1)*topk^2: SGLang starts but fails at the first verify."""


# ---------------------------------------------------------------------------------------------
# CUDA-graph capture lists (docs/sglang.md §3, `cuda_graph_hook.py::generate_decode_cuda_graph_batch_sizes`)


@functools.lru_cache(maxsize=1024)
def capture_sizes(max_bs: int, *, speculative: bool) -> tuple[int, ...]:
    """The decode batch sizes SGLang captures up to `max_bs` (the max itself always included)."""
    if max_bs < 1:
        raise ValueError(f"max captured batch size must be >= 1, got {max_bs}")
    if speculative:
        base = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, 4097, 16)]
    else:
        base = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 497, 16), *range(512, 4097, 32)]
    sizes = [s for s in base if s <= max_bs]
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return tuple(sizes)


def default_cuda_graph_max_bs(gpu_memory_gb: float, tp_size: int) -> int:
    """SGLang's default max captured batch by GPU memory (`memory_hook.py`, docs/sglang.md §3)."""
    big_tp = tp_size >= 4
    if gpu_memory_gb < 20:
        return 8
    if gpu_memory_gb < 35:
        return 160 if big_tp else 48
    if gpu_memory_gb < 60:
        return 160 if big_tp else 32
    if gpu_memory_gb < 160:
        return 512 if big_tp else 256
    return 512


@dataclass(frozen=True)
class GraphPlan:
    """How a server captures decode graphs: the sizes, and the request cap that cuts them."""

    sizes: tuple[int, ...]  # empty when graphs are disabled
    max_bs: int  # the resolved --cuda-graph-max-bs(-decode)
    max_running_requests: int

    @property
    def largest(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def padded(self, batch: int) -> int | None:
        """The captured size a batch is padded to, or None when it runs eagerly."""
        for s in self.sizes:
            if s >= batch:
                return s
        return None


@functools.lru_cache(maxsize=4096)
def graph_plan(
    landscape: Landscape,
    *,
    speculative: bool,
    cuda_graph_max_bs: int | None = None,
    max_running_requests: int | None = None,
    cuda_graph_bs: tuple[int, ...] | None = None,
    disable_cuda_graph: bool = False,
) -> GraphPlan:
    """Resolve max running requests and the capture list as SGLang does."""
    if max_running_requests is None:
        max_running_requests = (
            SPEC_DEFAULT_MAX_RUNNING_REQUESTS if speculative else landscape.max_running_requests_default
        )
    if max_running_requests < 1:
        raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
    if cuda_graph_bs:
        sizes = tuple(sorted(set(cuda_graph_bs)))
        max_bs = sizes[-1]
    else:
        if cuda_graph_max_bs is None:
            # A defaulted value is lowered to max running requests when that is smaller.
            max_bs = min(default_cuda_graph_max_bs(landscape.gpu_memory_gb, landscape.tp_size), max_running_requests)
        else:
            max_bs = cuda_graph_max_bs
        sizes = capture_sizes(max_bs, speculative=speculative)
    # The capture list is cut at the request pool (about max running requests).
    cut = tuple(s for s in sizes if s <= max_running_requests) or (min(sizes[0], max_running_requests),)
    return GraphPlan(sizes=() if disable_cuda_graph else cut, max_bs=max_bs, max_running_requests=max_running_requests)


class GraphEnvelope(TypedDict, total=False):
    """The server flags that shape its CUDA graphs (SGLang's names; absent or None: SGLang's default).

    Throughput, memory and start-up all depend on them, so each of those takes them alike."""

    cuda_graph_max_bs: int | None
    max_running_requests: int | None
    cuda_graph_bs: tuple[int, ...] | None
    disable_cuda_graph: bool


def envelope_plan(landscape: Landscape, spec: DraftTree | None, envelope: GraphEnvelope) -> GraphPlan:
    """The graphs a server of `spec` (None: no speculation) captures in `envelope`; an absent max
    captured batch falls back to the draft's own (`DraftLike.cuda_graph_max_bs`), then SGLang's default."""
    max_bs = envelope.get("cuda_graph_max_bs")
    if max_bs is None and spec is not None:
        max_bs = spec.cuda_graph_max_bs
    return graph_plan(
        landscape,
        speculative=spec is not None,
        cuda_graph_max_bs=max_bs,
        max_running_requests=envelope.get("max_running_requests"),
        cuda_graph_bs=envelope.get("cuda_graph_bs"),
        disable_cuda_graph=envelope.get("disable_cuda_graph", False),
    )


# ---------------------------------------------------------------------------------------------
# Acceptance


def depth_acceptance(landscape: Landscape, num_steps: int, topk: int, num_draft_tokens: int) -> tuple[float, ...]:
    """Conditional acceptance of each verified depth (length min(steps, draft tokens - 1))."""
    depth = min(num_steps, num_draft_tokens - 1)
    if depth <= 0:
        return ()
    width = min(float(topk), 1.0 + (num_draft_tokens - 1) / depth)
    keep = rejection_kept(landscape, width)
    rates = landscape.accept_by_depth
    return tuple(1.0 - (1.0 - rates[min(i, len(rates) - 1)]) * keep for i in range(depth))


def rejection_kept(landscape: Landscape, width: float) -> float:
    """The share of each depth's rejection probability a tree of effective `width` leaves: (1-g)
    per doubling, or each doubling its own cut (`Landscape.tree_gain_by_doubling`)."""
    if width <= 1.0:
        return 1.0
    gains = landscape.tree_gain_by_doubling
    if not gains:
        return float((1.0 - landscape.tree_gain) ** math.log2(width))
    kept, left, j = 1.0, math.log2(width), 0
    while left > 0.0:
        kept *= (1.0 - gains[min(j, len(gains) - 1)]) ** min(1.0, left)
        left -= 1.0
        j += 1
    return kept


# What is asked changes how often a draft is right (published EAGLE-3 accept lengths for one
# draft: MT-bench 2.7, GSM8K 3.3, HumanEval 3.5): code and arithmetic are more predictable than
# chat.  The landscapes are calibrated on chat; text with the symbols and digits of code or maths
# scales each depth's rejection down, by up to MAX_REJECT_CUT for code-dense text.
_CODE_CHARS = frozenset("{}()[];:=<>_#*/\\|&+-'\"`")
MAX_REJECT_CUT = 0.5


def text_reject_scale(text: str) -> float:
    """Multiplier of each depth's rejection probability for a prompt of this text (1.0: chat)."""
    if not text:
        return 1.0
    n = len(text)
    symbols = sum(c in _CODE_CHARS for c in text) / n
    digits = sum(c.isdigit() for c in text) / n
    indented = sum(1 for line in text.splitlines() if line.startswith(("    ", "\t"))) / max(1, text.count("\n") + 1)
    # Chat prose has ~1-3% such symbols: below 4% nothing changes, so the calibration holds.
    structure = min(1.0, max(0.0, symbols - 0.04) * 12 + max(0.0, digits - 0.03) * 6 + indented * 0.8)
    return 1.0 - MAX_REJECT_CUT * structure


def scaled_acceptance(rates: tuple[float, ...], reject_scale: float) -> tuple[float, ...]:
    """Depth acceptances with each rejection probability scaled (text_reject_scale)."""
    return tuple(1.0 - (1.0 - a) * reject_scale for a in rates)


def accept_length(rates: tuple[float, ...]) -> float:
    """Expected tokens per verify step, bonus token included."""
    total, p = 1.0, 1.0
    for a in rates:
        p *= a
        total += p
    return total


def sample_accept_tokens(rates: tuple[float, ...], rng: random.Random) -> int:
    """Tokens one request gains in one verify step (1 + accepted drafts), drawn per depth."""
    tokens = 1
    for a in rates:
        if rng.random() >= a:
            break
        tokens += 1
    return tokens


class AcceptAccumulator:
    """Noise-free acceptance: emits whole tokens whose running mean is exactly the expected AL.

    Used when noise is off, so a short measured run reproduces the model to the token instead of
    carrying the sampling spread of a geometric draw (~4% over 100 cycles).
    """

    __slots__ = ("_carry", "_al", "_cap")

    def __init__(self, rates: tuple[float, ...]) -> None:
        self._al = accept_length(rates)
        self._cap = len(rates) + 1
        self._carry = 0.0

    def next(self) -> int:
        total = self._carry + self._al
        tokens = min(self._cap, max(1, int(total)))
        self._carry = total - tokens
        return tokens


# ---------------------------------------------------------------------------------------------
# Timing


def forward_ms(landscape: Landscape, tokens: int) -> float:
    """Target forward over `tokens` tokens: concave for MoE (experts saturate), linear for dense."""
    extra = max(0, tokens - 1)
    knee = landscape.verify_knee
    # Tensor-core tiles: the GEMMs pad the token dimension to the tile, so cost steps up each
    # time the tokens cross a multiple of it (0 = no such steps).
    tiles = (tokens - 1) // landscape.verify_tile if landscape.verify_tile > 0 else 0
    return landscape.decode_ms * (
        1.0
        + landscape.verify_slope * min(extra, knee)
        + landscape.verify_slope_after * max(0, extra - knee)
        + landscape.verify_tile_jump * tiles
        + _expert_load(landscape, tokens)
    )


def _expert_load(landscape: Landscape, tokens: int) -> float:
    """Extra expert-weight loading over `tokens` tokens, in decode steps (0 without `moe_experts`)."""
    e, a = landscape.moe_experts, landscape.moe_active
    if e <= 0 or a <= 0 or tokens <= 1:
        return 0.0

    def touched(n: int) -> float:
        return e * (1.0 - (1.0 - a / e) ** n)

    return landscape.moe_expert_share * (touched(tokens) / touched(1) - 1.0)


@dataclass(frozen=True)
class Prediction:
    """Steady-state decode performance at one concurrency level (model time, no noise)."""

    output_tok_s: float  # all requests together
    per_user_tok_s: float  # one running request
    accept_length: float  # tokens per verify step, bonus included (1.0 without spec)
    accept_rate: float  # (AL - 1) / (draft tokens - 1); 0 without spec
    cycle_ms: float  # one verify cycle (or one decode step)
    draft_ms: float
    verify_ms: float
    overhead_ms: float
    cuda_graph: bool
    batch_size: int  # running requests (concurrency capped at max running requests)
    padded_batch_size: int
    max_running_requests: int
    cuda_graph_max_bs: int


def predict(
    landscape: Landscape,
    config: DraftLike | None,
    concurrency: int,
    *,
    draft_extend_graph: bool = True,
    draft_mismatch: bool = False,
    **envelope: Unpack[GraphEnvelope],
) -> Prediction:
    """Decode throughput of `config` (None: the baseline) with `concurrency` requests in flight.

    `cuda_graph_max_bs` falls back to `config.cuda_graph_max_bs`, then to SGLang's default.
    `draft_mismatch` models an EAGLE-3 draft run as `--speculative-algorithm EAGLE` (AL = 1).
    Raises InfeasibleConfigError for draft tokens over `max_draft_tokens` (SGLang fails at run time).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    spec = _canonical(config)
    plan = envelope_plan(landscape, spec, envelope)
    batch = min(concurrency, plan.max_running_requests)
    timing = cycle_timing(landscape, spec, batch, plan, draft_extend_graph=draft_extend_graph)
    if spec is None:
        al, rate = 1.0, 0.0
    else:
        rates = () if draft_mismatch else depth_acceptance(landscape, spec.num_steps, spec.topk, spec.num_draft_tokens)
        al = accept_length(rates)
        rate = (al - 1.0) / (spec.num_draft_tokens - 1)
    return _prediction(plan, batch, timing, al, rate)


def predict_adaptive(
    landscape: Landscape,
    adaptive: AdaptivePlan,
    concurrency: int,
    **envelope: Unpack[GraphEnvelope],
) -> Prediction:
    """Decode throughput of an adaptive server: the chain its slot gives this (padded) batch, or a
    plain decode step where that slot's steps are 0, in the speculative server's graph envelope."""
    plan = graph_plan(landscape, speculative=True, **envelope)
    batch = min(concurrency, plan.max_running_requests)
    padded = plan.padded(batch)
    steps = adaptive.steps_for(batch if padded is None else padded)
    tree = None if steps == 0 else DraftTree(num_steps=steps, topk=1, num_draft_tokens=steps + 1)
    timing = cycle_timing(landscape, tree, batch, plan)
    al = 1.0 if tree is None else accept_length(depth_acceptance(landscape, steps, 1, steps + 1))
    return _prediction(plan, batch, timing, al, 0.0 if tree is None else (al - 1.0) / steps)


def _prediction(plan: GraphPlan, batch: int, timing: CycleTiming, al: float, rate: float) -> Prediction:
    """The steady state of `batch` running requests whose cycles take `timing` and gain `al` tokens."""
    per_user = 1000.0 * al / timing.cycle_ms
    return Prediction(
        output_tok_s=batch * per_user,
        per_user_tok_s=per_user,
        accept_length=al,
        accept_rate=rate,
        cycle_ms=timing.cycle_ms,
        draft_ms=timing.draft_ms,
        verify_ms=timing.verify_ms,
        overhead_ms=timing.overhead_ms,
        cuda_graph=timing.cuda_graph,
        batch_size=batch,
        padded_batch_size=timing.padded_batch_size,
        max_running_requests=plan.max_running_requests,
        cuda_graph_max_bs=plan.max_bs,
    )


@dataclass(frozen=True)
class CycleTiming:
    cycle_ms: float
    draft_ms: float
    verify_ms: float
    overhead_ms: float
    cuda_graph: bool
    padded_batch_size: int


def cycle_timing(
    landscape: Landscape,
    spec: DraftTree | None,
    batch: int,
    plan: GraphPlan,
    *,
    draft_extend_graph: bool = True,
) -> CycleTiming:
    """Time of one decode step (baseline) or one draft+verify cycle for `batch` running requests."""
    padded = plan.padded(batch)
    graph = padded is not None
    b = padded if padded is not None else batch
    mult = 1.0 if graph else landscape.eager_penalty
    if spec is None:
        step = forward_ms(landscape, b) * mult
        return CycleTiming(step, 0.0, step, 0.0, graph, b)
    if graph and not draft_extend_graph:
        mult *= landscape.no_draft_extend_graph_penalty
    draft = (
        spec.num_steps
        * landscape.draft_step_frac
        * forward_ms(landscape, b)
        * (1.0 + landscape.draft_topk_slope * (spec.topk - 1))
    )
    if landscape.draft_step_latency_ms or landscape.draft_width_ms_per_token:
        draft += spec.num_steps * (
            landscape.draft_step_latency_ms + landscape.draft_width_ms_per_token * b * (spec.topk - 1)
        )
    verify = forward_ms(landscape, b * spec.num_draft_tokens)
    over = landscape.overhead_ms
    return CycleTiming((draft + verify + over) * mult, draft * mult, verify * mult, over * mult, graph, b)


def prefill_ms(landscape: Landscape, prompt_tokens: int, *, speculative: bool) -> float:
    """One prefill of `prompt_tokens` tokens (with spec the draft also extends over the prompt)."""
    ms = landscape.decode_ms + landscape.prefill_ms_per_token * prompt_tokens
    return ms * 1.1 if speculative else ms


def extend_ms(landscape: Landscape, new_tokens: int, *, speculative: bool) -> float:
    """One extend forward over `new_tokens` uncached tokens, all the requests of a batch together
    (each extending a prefix already in the cache).  It is the same target forward as a verify:
    `new_tokens` = b requests x k tokens costs F(b k), as t_v(b, k) does, tiles, knees and expert
    saturation included; so timing such extends on a running server traces the verify cost.  With
    spec the draft also extends over the new tokens (x1.1, as `prefill_ms`)."""
    ms = forward_ms(landscape, max(1, new_tokens))
    return ms * 1.1 if speculative else ms


def _canonical(config: DraftLike | None, *, check: bool = True) -> DraftTree | None:
    if config is None:
        return None
    c = DraftTree.of(config)
    if not check:
        return c
    limit = draft_token_limit(c.num_steps, c.topk)
    if c.num_draft_tokens > limit:
        raise InfeasibleConfigError(
            f"num_draft_tokens={c.num_draft_tokens} > topk+(num_steps-1)*topk^2+1={limit}: SGLang cannot fill the tree "
            "and fails at the first verify"
        )
    return c


# ---------------------------------------------------------------------------------------------
# Memory


@dataclass(frozen=True)
class MemoryCheck:
    """GPU memory per GPU at start-up; `failure` says which allocation would fail."""

    ok: bool
    failure: Literal["none", "weights", "kv_cache", "cuda_graph"]
    gpu_memory_gb: float
    mem_fraction_static: float
    weights_gb: float
    draft_gb: float
    kv_pool_gb: float
    token_capacity: int
    graph_decode_gb: float
    graph_target_verify_gb: float
    graph_draft_decode_gb: float
    graph_draft_extend_gb: float
    graph_available_gb: float

    @property
    def graph_gb(self) -> float:
        return (
            self.graph_decode_gb + self.graph_target_verify_gb + self.graph_draft_decode_gb + self.graph_draft_extend_gb
        )

    @property
    def required_gb(self) -> float:
        """What the server needs on each GPU: weights, draft, minimum KV pool, graphs, reserve."""
        return self.weights_gb + self.draft_gb + self.kv_pool_gb + self.graph_gb + self.graph_reserve_gb

    @property
    def graph_reserve_gb(self) -> float:
        return self.gpu_memory_gb * (1.0 - self.mem_fraction_static) - self.graph_available_gb


def check_memory(
    landscape: Landscape,
    config: DraftLike | None,
    *,
    mem_fraction_static: float | None = None,
    **envelope: Unpack[GraphEnvelope],
) -> MemoryCheck:
    """Does this server start?  Static pool = fraction x GPU (weights, draft, KV); graphs use the rest.

    Graph memory per phase ~ base + sizes x fixed + largest captured batch x tokens per request
    x bytes per token, so draft tokens dominate, as SGLang's "lower draft tokens first" OOM
    advice implies (docs/sglang.md §13).  An infeasible tree is checked too: SGLang starts it.
    """
    spec = _canonical(config, check=False)
    plan = envelope_plan(landscape, spec, envelope)
    frac = landscape.mem_fraction_default if mem_fraction_static is None else mem_fraction_static
    gpu = landscape.gpu_memory_gb
    draft = landscape.draft_gb if spec is not None else 0.0
    kv_pool = gpu * frac - landscape.weights_gb - draft
    avail = gpu * (1.0 - frac) - landscape.runtime_reserve_gb
    n_sizes, big = len(plan.sizes), plan.largest
    dec = verify = ddec = dext = 0.0
    if n_sizes:
        fixed = n_sizes * landscape.graph_per_size_gb
        if spec is None:
            dec = landscape.graph_base_gb + fixed + big * landscape.graph_decode_gb_per_token
        else:
            n = spec.num_draft_tokens
            verify = landscape.graph_base_gb + fixed + big * n * landscape.graph_verify_gb_per_token
            dext = fixed + big * n * landscape.graph_extend_gb_per_token
            if spec.num_steps > 1:
                ddec = fixed + big * spec.topk * spec.num_steps * landscape.graph_draft_gb_per_token
    graphs = dec + verify + ddec + dext
    if landscape.weights_gb + draft > gpu - landscape.runtime_reserve_gb:
        failure: Literal["none", "weights", "kv_cache", "cuda_graph"] = "weights"
    elif kv_pool < landscape.kv_min_gb:
        failure = "kv_cache"
    elif graphs > avail:
        failure = "cuda_graph"
    else:
        failure = "none"
    return MemoryCheck(
        ok=failure == "none",
        failure=failure,
        gpu_memory_gb=gpu,
        mem_fraction_static=frac,
        weights_gb=landscape.weights_gb,
        draft_gb=draft,
        kv_pool_gb=max(0.0, kv_pool),
        token_capacity=max(0, int(kv_pool / landscape.kv_gb_per_token)),
        graph_decode_gb=dec,
        graph_target_verify_gb=verify,
        graph_draft_decode_gb=ddec,
        graph_draft_extend_gb=dext,
        graph_available_gb=avail,
    )


def memory_required_gb(landscape: Landscape, config: DraftLike | None, **envelope: Unpack[GraphEnvelope]) -> float:
    """GB per GPU this server needs: weights + draft + minimum KV pool + graphs + runtime reserve."""
    m = check_memory(landscape, config, **envelope)
    return m.weights_gb + m.draft_gb + landscape.kv_min_gb + m.graph_gb + landscape.runtime_reserve_gb


# ---------------------------------------------------------------------------------------------
# Start-up


@dataclass(frozen=True)
class StartupPhases:
    """Seconds per start-up phase (real time before SPECTUNE_SIM_TIME_SCALE)."""

    load_s: float
    init_s: float
    capture_decode_s: float
    capture_target_verify_s: float
    capture_draft_decode_s: float
    capture_draft_extend_s: float
    prefill_graph_s: float
    warmup_s: float
    num_sizes: int

    @property
    def before_port_s(self) -> float:
        """Everything before the HTTP port opens (SGLang opens it after all graphs are captured)."""
        return (
            self.load_s
            + self.init_s
            + self.capture_decode_s
            + self.capture_target_verify_s
            + self.capture_draft_decode_s
            + self.capture_draft_extend_s
            + self.prefill_graph_s
        )

    @property
    def total_s(self) -> float:
        return self.before_port_s + self.warmup_s


def startup_phases(landscape: Landscape, config: DraftLike | None, **envelope: Unpack[GraphEnvelope]) -> StartupPhases:
    """T_start = load + init + N_sizes x (c_v(n) + c_x(n) + k c_d(t)) + prefill graph (calibration §6.6)."""
    spec = _canonical(config, check=False)
    plan = envelope_plan(landscape, spec, envelope)
    n = len(plan.sizes)
    w = landscape.capture_width_slope
    dec = verify = ddec = dext = 0.0
    if spec is None:
        dec = n * landscape.capture_decode_s
    else:
        nd = spec.num_draft_tokens
        verify = n * landscape.capture_verify_s * (1.0 + w * (nd - 1))
        dext = n * landscape.capture_extend_s * (1.0 + w * (nd - 1))
        if spec.num_steps > 1:  # the draft decode graph exists only with more than one step
            ddec = n * spec.num_steps * landscape.capture_draft_step_s * (1.0 + 5 * w * (spec.topk - 1))
    return StartupPhases(
        load_s=landscape.load_s,
        init_s=landscape.init_s,
        capture_decode_s=dec,
        capture_target_verify_s=verify,
        capture_draft_decode_s=ddec,
        capture_draft_extend_s=dext,
        prefill_graph_s=landscape.prefill_graph_s,
        warmup_s=landscape.warmup_s,
        num_sizes=n,
    )


def startup_seconds(landscape: Landscape, config: DraftLike | None, **envelope: Unpack[GraphEnvelope]) -> float:
    """Seconds from launch until `/ready` (before any time scale)."""
    return startup_phases(landscape, config, **envelope).total_s


# ---------------------------------------------------------------------------------------------
# The optimum


def true_optimum(
    landscape: Landscape,
    space: ConfigSpace[C],
    concurrency: int,
    *,
    max_running_requests: int | None = None,
    mem_fraction_static: float | None = None,
) -> tuple[C, float]:
    """The best configuration of `space` at `concurrency` and its speedup over the baseline.

    Configurations that would OOM at start-up are skipped.  `max_running_requests` defaults to
    `concurrency` (the worker always passes it, at least the largest benchmarked concurrency).
    """
    r = concurrency if max_running_requests is None else max_running_requests
    base = predict(landscape, None, concurrency, max_running_requests=r).output_tok_s
    best: tuple[C, float] | None = None
    for config in space.iter_configs():
        mem = check_memory(landscape, config, max_running_requests=r, mem_fraction_static=mem_fraction_static)
        if not mem.ok:
            continue
        tok_s = predict(landscape, config, concurrency, max_running_requests=r).output_tok_s
        if best is None or tok_s > best[1]:
            best = (config, tok_s)
    if best is None:
        raise ValueError(f"every configuration of the space runs out of memory on {landscape.name}")
    return best[0], best[1] / base


# ---------------------------------------------------------------------------------------------
# Noise


def _unit_hash(*parts: object) -> float:
    """A stable number in [0, 1) from the parts (Python's hash() is salted per process)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclass(frozen=True)
class NoiseModel:
    """Timing noise: a per-request lognormal factor, a per-host offset and a slow per-host drift.

    Factors multiply durations (> 1 is slower).  `sigma` = 0 turns all of it off.  The host
    offset and the drift hit the baseline and a speculative server alike, so they cancel in the
    speedup; `spec_host_sigma` is the part that does not: a per-host factor on speculative cycles
    only (another driver, clock or interconnect that treats the draft and verify kernels
    differently from a plain decode step), so identical configurations measure a different
    speedup on each host.
    """

    sigma: float = 0.02
    host_sigma: float = 0.015
    drift_amplitude: float = 0.01
    drift_period_s: float = 6 * 3600.0
    spec_host_sigma: float = 0.0

    def scaled(self, factor: float) -> NoiseModel:
        """The same model with `factor` times the timing noise and drift (Landscape.noise_scale)."""
        return dataclasses.replace(self, sigma=self.sigma * factor, drift_amplitude=self.drift_amplitude * factor)

    def spec_host_factor(self, seed: int, host_id: str) -> float:
        if self.sigma == 0.0 or self.spec_host_sigma == 0.0:
            return 1.0
        u = min(max(_unit_hash("spec-host", seed, host_id), 1e-12), 1 - 1e-12)
        return math.exp(self.spec_host_sigma * NormalDist().inv_cdf(u))

    def host_factor(self, seed: int, host_id: str) -> float:
        if self.sigma == 0.0:
            return 1.0
        u = min(max(_unit_hash("host", seed, host_id), 1e-12), 1 - 1e-12)
        return math.exp(self.host_sigma * NormalDist().inv_cdf(u))

    def drift_factor(self, seed: int, host_id: str, t_s: float) -> float:
        """Slow sinusoidal drift over wall time (seconds since the epoch), phase from the host."""
        if self.sigma == 0.0:
            return 1.0
        phase = 2 * math.pi * _unit_hash("drift", seed, host_id)
        return math.exp(self.drift_amplitude * math.sin(2 * math.pi * t_s / self.drift_period_s + phase))

    def request_factor(self, rng: random.Random) -> float:
        return rng.lognormvariate(0.0, self.sigma) if self.sigma > 0.0 else 1.0
