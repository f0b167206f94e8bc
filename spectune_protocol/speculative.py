"""EAGLE-3 configurations as typed values, with SGLang's resolution rules (the search space over
them is optimizer.space).

The rules (docs/sglang.md §2, `speculative_hook.py::_handle_eagle_family` in SGLang 0.5.23):

* topk = 1 forces num_draft_tokens = num_steps + 1 (SGLang only warns and adjusts), so with a
  chain the draft-token count is derived, never searched;
* num_draft_tokens - 1 <= topk + (num_steps - 1) * topk^2: `organize_draft_results` takes the
  top (draft tokens - 1) of the candidate scores of every draft step (topk after the first step,
  topk*topk after each later one); asking for more fails at run time, and SGLang does not check
  it at start-up, so we never launch such a point.  (`bench_speculative.py`'s steps*topk + 1 is
  stricter than the server and leaves out real trees such as 3/2/10 or 5/8/49.);
* num_draft_tokens >= 2 (the root plus at least one draft token);
* with topk > 1, steps beyond draft tokens - 1 are dominated: a selected node's ancestors score
  higher, so the tree is at most draft tokens - 1 deep, and more steps are extra draft passes
  whose candidates are never selected.  Such configurations are valid for SGLang but never worth
  a launch: the search space leaves them out (`SpecConfig.dominated`).

`canonical()` applies these rules, so two parameter sets that SGLang resolves to the same server
compare (and hash, and key) equal.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from spectune_protocol.errors import SpecError

MIN_DRAFT_TOKENS = 2
# The most draft tokens a configuration may ask for (SpecConfig's limit; SGLang allocates a tree
# of this many nodes per request).
MAX_DRAFT_TOKENS = 1024
MAX_STEPS = 64
MAX_TOPK = 64


BOUND_TEXT = "draft tokens - 1 <= topk + (steps - 1) * topk^2"


def max_draft_tokens(num_steps: int, topk: int) -> int:
    """The largest draft-token count SGLang can fill for a tree of this depth and width.

    A chain (topk 1) has exactly steps + 1; a tree offers topk candidates after the first draft
    step and topk^2 after each later one, plus the root.
    """
    if topk == 1:
        return num_steps + 1
    return topk + (num_steps - 1) * topk * topk + 1


class SpecConfig(BaseModel):
    """One speculative configuration, as SGLang will run it once `canonical()` has been applied."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_steps: int = Field(ge=1, le=MAX_STEPS)
    topk: int = Field(ge=1, le=MAX_TOPK)
    num_draft_tokens: int = Field(ge=1, le=MAX_DRAFT_TOKENS)
    # Largest captured CUDA-graph batch size; None means "whatever the study's workload needs".
    cuda_graph_max_bs: int | None = Field(default=None, ge=1, le=4096)

    def canonical(self) -> SpecConfig:
        """The configuration SGLang would actually run for these flags."""
        if self.topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            return self.model_copy(update={"num_draft_tokens": self.num_steps + 1})
        return self

    def check(self) -> SpecConfig:
        """Return the canonical form, or raise SpecError when SGLang cannot run it."""
        c = self.canonical()
        limit = max_draft_tokens(c.num_steps, c.topk)
        if c.num_draft_tokens > limit:
            raise SpecError(
                "num_draft_tokens",
                f"{c.num_draft_tokens} draft tokens cannot be filled by {c.num_steps} steps of topk "
                f"{c.topk}: SGLang needs {BOUND_TEXT}, so at most {limit}",
            )
        if c.num_draft_tokens < MIN_DRAFT_TOKENS:
            raise SpecError("num_draft_tokens", f"must be at least {MIN_DRAFT_TOKENS}")
        return c

    @property
    def dominated(self) -> bool:
        """A tree deeper in steps than its draft tokens can use: same tree as steps = draft tokens - 1,
        more draft passes (module docstring).  Valid for SGLang, never worth a launch."""
        c = self.canonical()
        return c.topk > 1 and c.num_steps > c.num_draft_tokens - 1

    @property
    def key(self) -> str:
        """A stable text key of the canonical form (used for de-duplication in storage)."""
        c = self.canonical()
        bs = "auto" if c.cuda_graph_max_bs is None else str(c.cuda_graph_max_bs)
        return f"s{c.num_steps}-k{c.topk}-n{c.num_draft_tokens}-bs{bs}"

    @property
    def per_token_accept_denominator(self) -> int:
        return self.canonical().num_draft_tokens - 1
