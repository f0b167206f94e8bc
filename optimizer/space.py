"""The search space over EAGLE-3 configurations: which (steps, topk, draft tokens) a study may
launch and how many there are.

A configuration itself, with SGLang's resolution rules (`canonical()`, `dominated`), is the wire
type `spectune_protocol.speculative.SpecConfig`, re-exported here; those rules are stated there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from optimizer.errors import SpecError
from optimizer.policy import DEFAULT_POLICY
from spectune_protocol.speculative import BOUND_TEXT as BOUND_TEXT
from spectune_protocol.speculative import MAX_DRAFT_TOKENS as MAX_DRAFT_TOKENS
from spectune_protocol.speculative import MAX_STEPS as MAX_STEPS
from spectune_protocol.speculative import MAX_TOPK as MAX_TOPK
from spectune_protocol.speculative import MIN_DRAFT_TOKENS as MIN_DRAFT_TOKENS
from spectune_protocol.speculative import SpecConfig as SpecConfig
from spectune_protocol.speculative import max_draft_tokens as max_draft_tokens

# The configuration itself (its fields and SGLang's rules on them) travels in leases, so it is the
# wire package's (spectune_protocol.speculative); the space searched over it is this module's.


class IntRange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Bounded only so that no arithmetic meets a huge integer; validate_rules() names the real limits.
    low: int = Field(ge=-1_000_000, le=1_000_000)
    high: int = Field(ge=-1_000_000, le=1_000_000)

    def values(self) -> range:
        return range(self.low, self.high + 1)


class SearchSpace(BaseModel):
    """The user's search space (the study spec's `search_space`), validated against SGLang's rules."""

    model_config = ConfigDict(extra="forbid")

    num_steps: IntRange = Field(default_factory=lambda: IntRange(low=1, high=10))
    topk: list[int] = Field(default_factory=lambda: [1, 2, 4, 8], max_length=64)
    num_draft_tokens: IntRange = Field(default_factory=lambda: IntRange(low=2, high=64))
    cuda_graph_max_bs: list[int] | None = Field(default=None, max_length=64)

    @field_validator("num_steps", "num_draft_tokens", mode="before")
    @classmethod
    def _range_hint(cls, v: Any, info: ValidationInfo) -> Any:
        # A bare number or a list is the commonest slip; say what to write instead.
        if isinstance(v, int) and not isinstance(v, bool):
            raise ValueError(f"{info.field_name} is a range: write {{low: {v}, high: {v}}} for the single value {v}")
        if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ValueError(
                f"{info.field_name} is a range, not a list of choices: write {{low: {min(v)}, high: {max(v)}}}"
            )
        return v

    def validate_rules(self) -> None:
        """Raise SpecError naming the offending field when the space is empty or impossible."""
        s, n = self.num_steps, self.num_draft_tokens
        if s.low < 1 or s.high > MAX_STEPS or s.low > s.high:
            raise SpecError(
                "search_space.num_steps", f"need 1 <= low <= high <= {MAX_STEPS}, got low={s.low} high={s.high}"
            )
        if not self.topk:
            raise SpecError("search_space.topk", "give at least one choice, e.g. [1, 2, 4, 8]")
        if len(set(self.topk)) != len(self.topk) or any(t < 1 or t > MAX_TOPK for t in self.topk):
            raise SpecError("search_space.topk", f"choices must be distinct integers in 1..{MAX_TOPK}, got {self.topk}")
        if "num_draft_tokens" in self.model_fields_set and all(t == 1 for t in self.topk):
            raise SpecError(
                "search_space.num_draft_tokens",
                "with topk [1] SGLang sets the draft tokens to num_steps + 1 and ignores any other value "
                "(docs/sglang.md); remove num_draft_tokens, or add tree widths to topk (e.g. [1, 2, 4])",
            )
        if n.low < MIN_DRAFT_TOKENS or n.low > n.high or n.high > MAX_DRAFT_TOKENS:
            # Above MAX_DRAFT_TOKENS no configuration can be built (SpecConfig), so such a space
            # would fail on every report instead of here.
            raise SpecError(
                "search_space.num_draft_tokens",
                f"need {MIN_DRAFT_TOKENS} <= low <= high <= {MAX_DRAFT_TOKENS}, got low={n.low} high={n.high}",
            )
        tree_topks = [t for t in self.topk if t > 1]
        if tree_topks:
            limit = max_draft_tokens(s.high, max(tree_topks))
            if n.high > limit:
                raise SpecError(
                    "search_space.num_draft_tokens",
                    f"high={n.high} is over the limit: with num_steps.high={s.high} and topk "
                    f"{max(tree_topks)} SGLang can fill at most {limit} draft tokens ({BOUND_TEXT}); "
                    f"lower num_draft_tokens.high to {limit} or raise num_steps.high",
                )
        if self.cuda_graph_max_bs is not None:
            if not self.cuda_graph_max_bs or any(b < 1 or b > 4096 for b in self.cuda_graph_max_bs):
                raise SpecError("search_space.cuda_graph_max_bs", "choices must be integers in 1..4096, or null")
        if self.count_configs() == 0:
            raise SpecError("search_space", "no configuration satisfies SGLang's rules in this space")

    def contains(self, config: SpecConfig) -> bool:
        c = config.canonical()
        if c.num_steps not in self.num_steps.values() or c.topk not in self.topk:
            return False
        if c.topk > 1 and c.num_draft_tokens not in self.num_draft_tokens.values():
            return False
        if self.cuda_graph_max_bs is None:
            if c.cuda_graph_max_bs is not None:
                return False
        elif c.cuda_graph_max_bs not in self.cuda_graph_max_bs:
            return False
        if c.dominated:
            return False
        try:
            c.check()
        except SpecError:
            return False
        return True

    def count_configs(self) -> int:
        """How many configurations `iter_configs` yields, without building them.

        At most 64 x 64 steps of arithmetic (validate_rules bounds steps and topk first), so a
        space of a billion configurations is counted as fast as one of ten.
        """
        graphs = len(self.cuda_graph_max_bs or [None])
        n = 0
        for steps in self.num_steps.values():
            for topk in self.topk:
                if topk == 1:
                    n += 1
                else:
                    hi = min(self.num_draft_tokens.high, max_draft_tokens(steps, topk))
                    n += max(0, hi - max(self.num_draft_tokens.low, steps + 1) + 1)
        return n * graphs

    def iter_configs(self) -> Iterator[SpecConfig]:
        """Every valid canonical configuration, each once, in a stable order."""
        graph_choices: Sequence[int | None] = self.cuda_graph_max_bs or [None]
        for steps in self.num_steps.values():
            for topk in sorted(self.topk):
                if topk == 1:
                    ndts: Sequence[int] = [steps + 1]
                else:
                    hi = min(self.num_draft_tokens.high, max_draft_tokens(steps, topk))
                    # Dominated trees (steps > draft tokens - 1) are left out.
                    ndts = range(max(self.num_draft_tokens.low, steps + 1), hi + 1)
                for ndt in ndts:
                    for bs in graph_choices:
                        yield SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=ndt, cuda_graph_max_bs=bs)

    def config_from_params(self, params: dict[str, Any]) -> SpecConfig:
        """Turn Optuna params (see optimizer.study) into the canonical configuration to launch.

        With topk > 1 a sampled draft-token count above `max_draft_tokens` is clamped to that
        limit: SGLang cannot fill more, and the clamp keeps Optuna's distributions fixed, which TPE
        and GP need.  A dominated tree (steps > draft tokens - 1) becomes the one that dominates it
        (steps = draft tokens - 1, within the space's steps).  The result is then de-duplicated by
        its canonical key.
        """
        steps = int(params["num_steps"])
        topk = int(params["topk"])
        if topk == 1:
            ndt = steps + 1
        else:
            ndt = min(int(params.get("num_draft_tokens", self.num_draft_tokens.high)), max_draft_tokens(steps, topk))
            if steps > ndt - 1:
                steps = max(self.num_steps.low, ndt - 1)
                ndt = max(ndt, min(steps + 1, max_draft_tokens(steps, topk)))
        bs = params.get("cuda_graph_max_bs")
        return SpecConfig(
            num_steps=steps, topk=topk, num_draft_tokens=ndt, cuda_graph_max_bs=None if bs is None else int(bs)
        ).check()


def params_of(config: SpecConfig) -> dict[str, int]:
    """The Optuna params that reproduce `config` (used to enqueue warm starts and grids)."""
    c = config.canonical()
    params = {"num_steps": c.num_steps, "topk": c.topk}
    if c.topk > 1:
        params["num_draft_tokens"] = c.num_draft_tokens
    if c.cuda_graph_max_bs is not None:
        params["cuda_graph_max_bs"] = c.cuda_graph_max_bs
    return params


# SGLang's own defaults (docs/sglang.md §2 rule 1): (3,1,4) for most models, (5,4,8) for Llama.
SGLANG_DEFAULTS: tuple[SpecConfig, ...] = (
    SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
    SpecConfig(num_steps=5, topk=4, num_draft_tokens=8),
)
# Configurations published in SGLang's and EAGLE-3 trainers' measurements (docs/calibration.md
# §2: a chain of 7 in SGLang PRs #21599 and #23336, a 4-wide tree of 16 tokens in AngelSlim
# #163): what a fleet launches once the defaults are taken and no result is in yet, below
# the policy's `busy_from` (optimizer.model_sampler.blind_start), instead of random points.  Between them and the
# defaults the model's first fit sees draft positions up to 7 and a 16-token verify.
PUBLISHED_STARTS: tuple[SpecConfig, ...] = (
    SpecConfig(num_steps=7, topk=1, num_draft_tokens=8),
    SpecConfig(num_steps=4, topk=4, num_draft_tokens=16),
)
# From this many concurrent requests on (the objective's largest level), what is published runs
# short chains (docs/calibration.md §3: SGLang's own adaptive defaults try 0 or 1 step from 32
# requests; the speedups measured there at 32 and more are chains of 1-3): a chain of 2 and a
# chain of 1 instead of the chain of 7 and the tree of 16.  Measured (benchmarks/README.md,
# 2026-12-02 c): from 8 requests, the two cases at 16 got dearer with 4 workers (draft-mem-cliff
# 15 -> 17 launches); from 32, mem-tight at 64 went 15 -> 13 and no other case changed.  That
# threshold is the study's policy (optimizer.policy.busy_from).
PUBLISHED_STARTS_BUSY: tuple[SpecConfig, ...] = (
    SpecConfig(num_steps=2, topk=1, num_draft_tokens=3),
    SpecConfig(num_steps=1, topk=1, num_draft_tokens=2),
)


def published_starts(concurrency: int, busy_from: int = DEFAULT_POLICY.busy_from) -> tuple[SpecConfig, ...]:
    """The published configurations for a workload whose objective's largest level is
    `concurrency`: the busy ones from `busy_from` requests on (the study's policy)."""
    return PUBLISHED_STARTS_BUSY if concurrency >= busy_from else PUBLISHED_STARTS


def with_largest_graph(c: SpecConfig, space: SearchSpace) -> SpecConfig:
    """A default or published configuration in `space`: with graph tuning on, the largest graph
    choice (SGLang's own default is large); canonical."""
    graph = space.cuda_graph_max_bs
    return (c if graph is None else c.model_copy(update={"cuda_graph_max_bs": max(graph)})).canonical()
