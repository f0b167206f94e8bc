"""The simulator's own statement of SGLang's rules (docs/sglang.md §1-2, read from the 0.5.x wheels).

The simulator is a test double for the tuner: it must not import the tuner's rule code, or a bug
there would be copied faithfully by the engine meant to catch it.  So the flag generations, the
draft-tree bound and the topk-1 rewrite are written here again, from SGLang's behaviour, and
`tests/sim/test_rules.py` checks on a sample that both statements agree.

- CUDA-graph flag names: <= 0.5.13 `--cuda-graph-max-bs`/`--cuda-graph-bs`; 0.5.16-0.5.19 the
  `-decode` names with the old ones as aliases; >= 0.5.20 the `-decode` names only (the old ones
  are then ambiguous prefixes and argparse exits 2).
- topk 1: SGLang sets draft tokens to steps + 1 whatever was asked (a warning, no error).
- A tree of `steps` and `topk` fills at most topk + (steps - 1)·topk² candidates, plus the root:
  draft tokens - 1 <= topk + (steps - 1)·topk².  SGLang does not check it at start-up; the first
  verify fails (`eagle_utils.organize_draft_results`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Protocol


class GraphFlags(StrEnum):
    """The three generations of SGLang's CUDA-graph flag names."""

    LEGACY = "legacy"  # up to 0.5.15: --cuda-graph-max-bs / --cuda-graph-bs
    ALIASED = "0.5.16"  # 0.5.16 .. 0.5.19: the -decode names, the old ones still accepted
    DECODE_ONLY = "0.5.20"  # 0.5.20 on: the -decode names only


_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")


def graph_flags(version: str) -> GraphFlags:
    """Which CUDA-graph flag names SGLang `version` (e.g. "0.5.23") accepts."""
    v = version_tuple(version)
    if v < (0, 5, 16):
        return GraphFlags.LEGACY
    if v < (0, 5, 20):
        return GraphFlags.ALIASED
    return GraphFlags.DECODE_ONLY


def draft_token_limit(num_steps: int, topk: int) -> int:
    """The most draft tokens (root included) SGLang can fill for a tree of this depth and width."""
    return 1 + topk + (num_steps - 1) * topk * topk


class DraftLike(Protocol):
    """Anything with EAGLE's three tree settings (the tuner's SpecConfig is one)."""

    @property
    def num_steps(self) -> int: ...

    @property
    def topk(self) -> int: ...

    @property
    def num_draft_tokens(self) -> int: ...


@dataclass(frozen=True)
class DraftTree:
    """One EAGLE draft tree as the simulated server runs it; `cuda_graph_max_bs` None: the default."""

    num_steps: int
    topk: int
    num_draft_tokens: int
    cuda_graph_max_bs: int | None = None

    @classmethod
    def of(cls, config: DraftLike) -> DraftTree:
        """The tree SGLang runs for these flags (topk 1 rewrites the draft tokens to steps + 1)."""
        tree = cls(
            num_steps=config.num_steps,
            topk=config.topk,
            num_draft_tokens=config.num_draft_tokens,
            cuda_graph_max_bs=getattr(config, "cuda_graph_max_bs", None),
        )
        if tree.topk == 1 and tree.num_draft_tokens != tree.num_steps + 1:
            return replace(tree, num_draft_tokens=tree.num_steps + 1)
        return tree

    @property
    def fillable(self) -> bool:
        """Whether SGLang can fill this many draft tokens (else the first verify fails)."""
        return self.num_draft_tokens <= draft_token_limit(self.num_steps, self.topk)

    @property
    def label(self) -> str:
        return f"{self.num_steps}/{self.topk}/{self.num_draft_tokens}"


@dataclass(frozen=True)
class TreeGrid:
    """Every tree SGLang can run in these ranges (the default: steps 1-10, topk 1/2/4/8, 2-64 tokens).

    Trees deeper than their draft tokens can use (topk > 1, steps > draft tokens - 1) are left
    out: a selected node's ancestors score higher, so such a tree is the one of steps = draft
    tokens - 1 with more draft passes, and never the fastest.
    """

    steps: range = range(1, 11)
    topks: tuple[int, ...] = (1, 2, 4, 8)
    draft_tokens: range = range(2, 65)

    def iter_configs(self) -> Iterator[DraftTree]:
        for s in self.steps:
            for k in sorted(self.topks):
                if k == 1:
                    yield DraftTree(s, 1, s + 1)
                    continue
                low = max(self.draft_tokens.start, s + 1)
                high = min(self.draft_tokens.stop - 1, draft_token_limit(s, k))
                for n in range(low, high + 1):
                    yield DraftTree(s, k, n)


# ---------------------------------------------------------------------------------------------
# Adaptive speculation (`--speculative-adaptive`, `--speculative-adaptive-config FILE`)
#
# SGLang's behaviour, as this simulator states it (from the 0.5.10, 0.5.13, 0.5.16 and 0.5.23
# wheels):
# - the two flags exist from 0.5.13 on (0.5.10 has neither: argparse exits 2 on them);
# - the file is a JSON object; keys made only of digits are batch sizes, other keys are tuning
#   knobs shared by every slot; each batch size holds `candidate_steps`, a non-empty list of
#   integers, >= 1 in 0.5.13 and >= 0 from 0.5.16 (0: no drafting at that batch size); no batch
#   size key at all, or a bad list, is a ValueError at start-up;
# - adaptive mode is silently switched off (a warning, static settings) for algorithms other than
#   EAGLE/EAGLE3, for topk other than 1 and with attention data parallelism;
# - otherwise topk defaults to 1, steps to the middle of the union of candidate steps, steps
#   outside that union are a ValueError, and draft tokens become steps + 1;
# - a running batch is padded to its CUDA-graph size and served by the slot of the largest batch
#   size key not above it (the smallest key when below all of them); a slot starts at the
#   initial steps when they are among its candidates, else at its middle candidate.  SGLang then
#   moves a slot between its candidates by its acceptance; this simulator keeps each slot at its
#   starting steps (a slot with one candidate, what spectune deploys, never moves anyway).

ADAPTIVE_SINCE = (0, 5, 13)
ADAPTIVE_STEPS_OFF_SINCE = (0, 5, 16)


def version_tuple(version: str) -> tuple[int, int, int]:
    m = _VERSION.match(version.strip())
    if m is None:
        raise ValueError(f"SPECTUNE_SIM_SGLANG_VERSION={version!r}: write a version such as 0.5.23")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def has_adaptive(version: str) -> bool:
    return version_tuple(version) >= ADAPTIVE_SINCE


def adaptive_slots(doc: object, version: str) -> dict[int, list[int]]:
    """The batch-size slots of an adaptive config document, checked as SGLang `version` checks them."""
    if not isinstance(doc, dict):
        raise ValueError(f"speculative_adaptive_config must be a JSON object, got {type(doc).__name__}")
    floor = 0 if version_tuple(version) >= ADAPTIVE_STEPS_OFF_SINCE else 1
    slots: dict[int, list[int]] = {}
    for key, entry in doc.items():
        if not key.isdigit():
            continue
        steps = entry.get("candidate_steps") if isinstance(entry, dict) else None
        if (
            not isinstance(steps, list)
            or not steps
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= floor for s in steps)
        ):
            kind = "non-negative" if floor == 0 else "positive"
            raise ValueError(f"BS {key}: candidate_steps must be a list of {kind} ints, got {steps!r}")
        slots[int(key)] = sorted(set(steps))
    if not slots:
        raise ValueError(
            'speculative_adaptive_config must contain at least one integer-string BS key, e.g. {"1": '
            f'{{"candidate_steps": [1,3,7]}}}}. Got keys: {list(doc)}'
        )
    return slots


@dataclass(frozen=True)
class AdaptivePlan:
    """The steps an adaptive server runs at each batch-size slot."""

    steps_by_slot: tuple[tuple[int, int], ...]  # (batch size key, steps), keys ascending

    @classmethod
    def start(cls, slots: dict[int, list[int]], initial_steps: int) -> AdaptivePlan:
        return cls(
            tuple(
                (bs, initial_steps if initial_steps in cands else cands[len(cands) // 2])
                for bs, cands in sorted(slots.items())
            )
        )

    def steps_for(self, padded_batch: int) -> int:
        """The slot of the largest key not above the (padded) batch; the smallest key below them all."""
        chosen = self.steps_by_slot[0][1]
        for bs, steps in self.steps_by_slot:
            if bs <= padded_batch:
                chosen = steps
        return chosen

    @property
    def largest_steps(self) -> int:
        return max(s for _, s in self.steps_by_slot)
