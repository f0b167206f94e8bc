"""The simulated scheduler: one asyncio task that batches running requests and paces cycles.

Each cycle lasts T(b)/speed seconds for the current batch b (from `model.cycle_timing`), and
every running request gains the tokens it accepted in that cycle (drawn from the acceptance
model, or, with noise off, an exact running mean).  So accept length, tok/s and their fall with
concurrency emerge from the model rather than being replayed.  Requests beyond max running
requests wait, as in SGLang.  Tokens arrive in bursts, one chunk per verify cycle.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

from spectune_sim.landscapes import Landscape
from spectune_sim.model import (
    AcceptAccumulator,
    GraphPlan,
    NoiseModel,
    accept_length,
    cycle_timing,
    depth_acceptance,
    extend_ms,
    prefill_ms,
    sample_accept_tokens,
    scaled_acceptance,
)
from spectune_sim.rules import AdaptivePlan, DraftTree, draft_token_limit

# A tiny fixed vocabulary: the simulator has no tokenizer, but text must grow with the tokens.
_WORDS = tuple(
    " " + w
    for w in (
        "the of and to in is that for it as with was on be by at this are from or an have not they which "
        "one you were all we when there can more time will so about if out up its what said some into "
        "model token draft verify cycle batch graph tree step accept speed tune"
    ).split()
)
EOS_TOKEN_ID = 128009


def word_of(token_id: int) -> str:
    return _WORDS[token_id % len(_WORDS)]


@dataclass(frozen=True)
class EngineOptions:
    """Everything the scheduler needs, injected by the server."""

    landscape: Landscape
    spec: DraftTree | None
    plan: GraphPlan
    speed: float  # multiplies every rate; wall seconds = model seconds / speed
    noise: NoiseModel
    seed: int
    host_id: str
    decode_log_interval: int = 40
    draft_mismatch: bool = False
    draft_extend_graph: bool = True
    infeasible: bool = False  # draft tokens > steps*topk+1: the first verify fails
    # `--speculative-adaptive`: each batch runs its slot's chain (steps 0: a plain decode step).
    adaptive: AdaptivePlan | None = None


@dataclass(frozen=True)
class Chunk:
    """What one request gained in one step; `error` set when the request failed."""

    new_ids: tuple[int, ...]
    finished: bool
    error: str | None = None


@dataclass
class Request:
    rid: str
    prompt_tokens: int
    max_new_tokens: int
    stop_after: int  # tokens after which EOS is "generated" (max_new_tokens with ignore_eos)
    created: float
    noise_log: float
    queue: asyncio.Queue[Chunk] = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    verify_ct: int = 0
    correct_drafts: int = 0
    finish_reason: dict[str, object] | None = None
    acc: AcceptAccumulator | None = None
    # This request's acceptance per depth (the landscape's, scaled by what its prompt asks).
    rates: tuple[float, ...] = ()
    reject_scale: float = 1.0
    # An adaptive server's chains: rates and noise-free accumulators per steps.
    rates_by_steps: dict[int, tuple[float, ...]] = field(default_factory=dict)
    acc_by_steps: dict[int, AcceptAccumulator] = field(default_factory=dict)
    first_token_at: float | None = None
    finished_at: float | None = None
    # Prompt tokens already in the prefix cache (the server's PrefixCache): only the rest is
    # computed, in one extend forward with the other such requests admitted with it.
    cached_tokens: int = 0


@dataclass
class Counters:
    """Server-wide counters for /metrics, /server_info and the decode log lines."""

    generation_tokens: int = 0
    spec_tokens: int = 0  # tokens produced by verify steps
    verify_calls: int = 0
    correct_drafts: int = 0
    prompt_tokens: int = 0
    requests_finished: int = 0
    forward_iterations: int = 0
    # Folded only when a decode log line is written, as SGLang does (docs/sglang.md §5: it lags).
    published_spec_tokens: int = 0
    published_verify_calls: int = 0
    last_gen_throughput: float = 0.0
    last_accept_length: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    cuda_graph: bool = True
    e2e_latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)

    @property
    def avg_spec_accept_length(self) -> float:
        if self.published_verify_calls == 0:
            return 0.0
        return self.published_spec_tokens / self.published_verify_calls


class Engine:
    """Owns the running batch.  `submit()` returns a Request whose queue yields Chunks."""

    def __init__(self, options: EngineOptions, log: logging.Logger) -> None:
        self.o = options
        self.log = log
        self.counters = Counters()
        self._rng = random.Random(f"{options.seed}/{options.host_id}/engine")
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._wake = asyncio.Event()
        self._ids = itertools.count()
        self._rates = (
            ()
            if options.spec is None or options.draft_mismatch
            else depth_acceptance(
                options.landscape, options.spec.num_steps, options.spec.topk, options.spec.num_draft_tokens
            )
        )
        self._host = options.noise.host_factor(options.seed, options.host_id)
        if options.spec is not None:
            self._host *= options.noise.spec_host_factor(options.seed, options.host_id)
        self._cycle_cache: dict[int, tuple[float, bool, DraftTree | None]] = {}
        self._chain_rates: dict[int, tuple[float, ...]] = {}
        self._log_window_start = time.monotonic()
        self._log_window_tokens = 0
        self._log_window_spec_tokens = 0
        self._log_window_verify = 0
        self.failed: str | None = None
        # The infeasible-tree failure fires on the first user generate, not on the server's own
        # warmup (the server sets this once it is ready).
        self.failure_armed = False

    @property
    def idle(self) -> bool:
        return not self._running and not self._waiting

    @property
    def expected_accept_length(self) -> float:
        return accept_length(self._rates) if self.o.spec is not None else 1.0

    def submit(
        self,
        prompt_tokens: int,
        max_new_tokens: int,
        *,
        ignore_eos: bool,
        reject_scale: float = 1.0,
        cached_tokens: int = 0,
    ) -> Request:
        """Queue a request; `reject_scale` (model.text_reject_scale of its prompt) makes its drafts
        more often right (code, maths) or leaves the landscape's chat calibration (1.0);
        `cached_tokens` of its prompt are in the prefix cache (at least one token is computed)."""
        noise = self.o.noise
        stop_after = max_new_tokens
        if not ignore_eos:
            # Without ignore_eos the "model" ends on its own: a geometric length with mean 256.
            stop_after = min(max_new_tokens, 1 + int(self._rng.expovariate(1 / 256)))
        req = Request(
            rid=f"{next(self._ids):x}{self._rng.getrandbits(64):016x}",
            prompt_tokens=max(1, prompt_tokens),
            max_new_tokens=max_new_tokens,
            stop_after=max(0, stop_after),
            created=time.monotonic(),
            noise_log=0.0 if noise.sigma == 0 else self._rng.gauss(0.0, noise.sigma),
        )
        req.reject_scale = round(reject_scale, 3)
        req.cached_tokens = max(0, min(cached_tokens, req.prompt_tokens - 1))
        req.rates = self._rates if reject_scale == 1.0 else scaled_acceptance(self._rates, req.reject_scale)
        if noise.sigma == 0.0:
            req.acc = AcceptAccumulator(req.rates)
        if max_new_tokens <= 0:
            self._finish(req, {"type": "length", "length": 0})
            return req
        self._waiting.append(req)
        self.counters.num_waiting = len(self._waiting)
        self._wake.set()
        return req

    def abort(self, req: Request) -> None:
        """Drop a request whose client went away."""
        if req.finish_reason is None:
            req.finish_reason = {"type": "abort", "message": "client disconnected"}
            if req in self._running:
                self._running.remove(req)
            elif req in self._waiting:
                self._waiting.remove(req)

    def abort_all(self, message: str) -> None:
        for req in [*self._running, *self._waiting]:
            req.queue.put_nowait(Chunk((), True, message))
        self._running.clear()
        self._waiting.clear()

    async def run(self) -> None:
        """The scheduler loop; runs until cancelled."""
        deadline = time.monotonic()
        while True:
            if self.idle:
                self._wake.clear()
                self.counters.num_running = 0
                await self._wake.wait()
                deadline = time.monotonic()
                # Idle time is not generation time: restart the throughput window of the log line.
                self._log_window_start = deadline
            deadline = max(deadline, time.monotonic() - 0.05)  # don't replay a long stall at once
            new: list[Request] = []
            while self._waiting and len(self._running) + len(new) < self.o.plan.max_running_requests:
                new.append(self._waiting.popleft())
            self.counters.num_waiting = len(self._waiting)
            if new:
                deadline += self._admit_ms(new) / 1000.0 / self.o.speed
                await _sleep_until(deadline)
                now = time.monotonic()
                for req in new:
                    self.counters.prompt_tokens += req.prompt_tokens
                    req.first_token_at = now
                    self._emit(req, 1)
                    if req.finish_reason is None:
                        self._running.append(req)
                continue
            if not self._running:
                continue
            b = len(self._running)
            self.counters.num_running = b
            cycle_ms, graph, tree = self._cycle(b)
            factor = self._noise_factor()
            deadline += cycle_ms * factor / 1000.0 / self.o.speed
            await _sleep_until(deadline)
            if self.o.infeasible and self.failure_armed:
                self._fail_infeasible()
                continue
            self.counters.forward_iterations += 1
            self.counters.cuda_graph = graph
            for req in list(self._running):
                if tree is None:
                    gained = 1
                else:
                    gained = self._accepted(req, tree)
                    req.verify_ct += 1
                    self.counters.verify_calls += 1
                    self._log_window_verify += 1
                    # Tokens past max_new_tokens are dropped, as SGLang does with an over-long accept.
                    gained = min(gained, req.stop_after - len(req.output_ids))
                    req.correct_drafts += gained - 1
                    self.counters.correct_drafts += gained - 1
                    self.counters.spec_tokens += gained
                    self._log_window_spec_tokens += gained
                self._emit(req, gained)
            if self.counters.forward_iterations % self.o.decode_log_interval == 0:
                self._log_decode(b, graph, tree)
            self._running = [r for r in self._running if r.finish_reason is None]

    def _admit_ms(self, new: list[Request]) -> float:
        """Model ms to admit `new`: each uncached prompt's prefill, and one extend forward over the
        uncached tokens of the requests that extend a cached prefix (`model.extend_ms`: the verify
        cost's form), at the noise of a cycle of those requests."""
        spec = self.o.spec is not None
        ms = sum(prefill_ms(self.o.landscape, r.prompt_tokens, speculative=spec) for r in new if not r.cached_tokens)
        extending = [r for r in new if r.cached_tokens]
        if extending:
            tokens = sum(r.prompt_tokens - r.cached_tokens for r in extending)
            ms += extend_ms(self.o.landscape, tokens, speculative=spec) * self._noise_of(extending)
        return ms

    def _cycle(self, batch: int) -> tuple[float, bool, DraftTree | None]:
        """One cycle's time, whether it ran a graph, and the draft tree it ran (None: no drafting)."""
        hit = self._cycle_cache.get(batch)
        if hit is None:
            tree = self._tree_at(batch)
            t = cycle_timing(self.o.landscape, tree, batch, self.o.plan, draft_extend_graph=self.o.draft_extend_graph)
            hit = self._cycle_cache[batch] = (t.cycle_ms, t.cuda_graph, tree)
        return hit

    def _tree_at(self, batch: int) -> DraftTree | None:
        """The tree a batch of this size runs: the static one, or its adaptive slot's chain."""
        if self.o.spec is None or self.o.adaptive is None:
            return self.o.spec
        padded = self.o.plan.padded(batch)
        steps = self.o.adaptive.steps_for(batch if padded is None else padded)
        return None if steps == 0 else DraftTree(num_steps=steps, topk=1, num_draft_tokens=steps + 1)

    def _accepted(self, req: Request, tree: DraftTree) -> int:
        """Tokens a request gains in one verify of `tree` (1 + its accepted drafts)."""
        if self.o.adaptive is None:
            return req.acc.next() if req.acc is not None else sample_accept_tokens(req.rates, self._rng)
        steps = tree.num_steps
        rates = req.rates_by_steps.get(steps)
        if rates is None:
            base = self._chain_rates.get(steps)
            if base is None:
                base = self._chain_rates[steps] = (
                    () if self.o.draft_mismatch else depth_acceptance(self.o.landscape, steps, 1, steps + 1)
                )
            rates = req.rates_by_steps[steps] = (
                base if req.reject_scale == 1.0 else scaled_acceptance(base, req.reject_scale)
            )
        if self.o.noise.sigma != 0.0:
            return sample_accept_tokens(rates, self._rng)
        acc = req.acc_by_steps.get(steps)
        if acc is None:
            acc = req.acc_by_steps[steps] = AcceptAccumulator(rates)
        return acc.next()

    def _noise_factor(self) -> float:
        return self._noise_of(self._running)

    def _noise_of(self, batch: list[Request]) -> float:
        if self.o.noise.sigma == 0.0 or not batch:
            return 1.0
        # Requests carry their own lognormal factor; a batch runs at the mean of its members'.
        mean_log = sum(r.noise_log for r in batch) / len(batch)
        drift = self.o.noise.drift_factor(self.o.seed, self.o.host_id, time.time())
        return self._host * drift * math.exp(mean_log)

    def _emit(self, req: Request, count: int) -> None:
        remaining = req.stop_after - len(req.output_ids)
        count = max(0, min(count, remaining))
        start = len(req.output_ids)
        ids = tuple(self._token_id(req, start + i) for i in range(count))
        req.output_ids.extend(ids)
        self.counters.generation_tokens += count
        self._log_window_tokens += count
        done = len(req.output_ids) >= req.stop_after
        if done:
            if req.stop_after < req.max_new_tokens:
                reason: dict[str, object] = {"type": "stop", "matched": EOS_TOKEN_ID}
            else:
                reason = {"type": "length", "length": req.max_new_tokens}
            self._finish(req, reason, ids)
        else:
            req.queue.put_nowait(Chunk(ids, False))

    def _finish(self, req: Request, reason: dict[str, object], ids: tuple[int, ...] = ()) -> None:
        req.finish_reason = reason
        req.finished_at = time.monotonic()
        self.counters.requests_finished += 1
        self.counters.e2e_latencies.append(req.finished_at - req.created)
        if req.first_token_at is not None:
            self.counters.ttfts.append(req.first_token_at - req.created)
        req.queue.put_nowait(Chunk(ids, True))

    @staticmethod
    def _token_id(req: Request, position: int) -> int:
        return (int(req.rid[-8:], 16) + 7919 * position) % 32000 + 100

    def _fail_infeasible(self) -> None:
        spec = self.o.spec
        assert spec is not None
        message = (
            f"RuntimeError: selected index k out of range: draft tokens {spec.num_draft_tokens} > "
            f"topk+(num_steps-1)*topk^2+1 = {draft_token_limit(spec.num_steps, spec.topk)} in "
            "eagle_utils.organize_draft_results"
        )
        self.failed = message
        self.log.error(
            "Scheduler hit an exception: Traceback (most recent call last):\n"
            '  File "sglang/srt/speculative/eagle_utils.py", line 212, in organize_draft_results\n'
            "    top_scores = torch.topk(score_list, num_draft_token - 1, dim=-1)\n%s",
            message,
        )
        self.abort_all(message)

    def _log_decode(self, batch: int, graph: bool, tree: DraftTree | None) -> None:
        now = time.monotonic()
        elapsed = max(now - self._log_window_start, 1e-9)
        thr = self._log_window_tokens / elapsed
        c = self.counters
        c.last_gen_throughput = thr
        c.published_spec_tokens = c.spec_tokens
        c.published_verify_calls = c.verify_calls
        used = sum(r.prompt_tokens + len(r.output_ids) for r in self._running)
        parts = [f"Decode batch, #running-req: {batch}", f"#token: {used}", f"token usage: {used / 1e6:.2f}"]
        if tree is not None:
            al = self._log_window_spec_tokens / self._log_window_verify if self._log_window_verify else 0.0
            denom = tree.num_draft_tokens - 1
            c.last_accept_length = al
            parts += [f"accept len: {al:.2f}", f"accept rate: {(al - 1) / denom if denom else 0.0:.2f}"]
        parts += [f"cuda graph: {graph}", f"gen throughput (token/s): {thr:.2f}", f"#queue-req: {len(self._waiting)}"]
        self.log.info(", ".join(parts))
        self._log_window_start = now
        self._log_window_tokens = self._log_window_spec_tokens = self._log_window_verify = 0


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    await asyncio.sleep(delay if delay > 0 else 0)
