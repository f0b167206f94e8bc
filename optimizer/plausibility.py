"""Is a worker's report possible, and consistent with what the study already knows?  (issue 35)

Each number a worker reports is bounded alone at the door (spectune_protocol), but a stolen worker
token once decided two users' answers with numbers each in range: a baseline of 0.001 tok/s, then
trials at 1e9 (a 1e12x "speedup").  So before a result is trusted it is weighed against the
engine's physics and the study's own evidence; a report that fails is quarantined with the
reason these functions give (api.services.leasing.plausible): recorded and shown, never scored,
never told to Optuna as a value.

Pure: no database, no clock; every bound states where it comes from.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from optimizer.space import SpecConfig
from optimizer.spec import Workload

# A speedup above the accept length, by more than this factor, is impossible.  Throughput is
# accept length / cycle time (docs/design.md "Why a configuration wins or loses"), and a cycle
# holds at least one target forward pass (the verify), which costs at least the baseline's decode
# step at the same batch: so speedup <= accept length.  The factor leaves room for the two
# measurements' noise (a few percent between passes, docs/calibration.md) many times over.
SPEEDUP_OVER_ACCEPT = 1.5
# Accept length is accepted drafts plus the bonus token: at most num_steps + 1 per cycle
# (docs/sglang.md §7, SGLang's spec_verify_ct counts cycles).  This factor is the same noise room.
ACCEPT_OVER_STEPS = 1.05
# A baseline more than this factor off the median of other tokens' baselines of the same server
# and workload (or its host's own earlier one) is not a measurement of that server.  Decode is
# memory-bound, so hosts differ about as their GPUs' memory bandwidth: H200 (4.8 TB/s) to L40S
# (0.86 TB/s) is 5.6x; 8 leaves room for noise and a busy host.
BASELINE_FACTOR = 8.0
# A report cannot claim a rate at which its own tokens would take longer than its lease has
# lasted (database clock, leased_at to the report).  The slack covers clock granularity and a
# report resent from the worker's outbox; a liar's 0.001 tok/s is off by years.
PACE_SLACK_S = 60.0
# Checked only for rates below this: the slowest server that motivated the project, a large MoE at
# TP8 over PCIe, decoded 90 tok/s at concurrency 1 (docs/calibration.md §1); a level 90x slower
# than that is suspect, while clients that report at once (a benchmark driven by hand, the tests)
# at real rates are not timed.
PACE_CHECKED_BELOW_TOK_S = 1.0


@dataclass(frozen=True)
class Level:
    """One reported level, as the checks read it."""

    concurrency: int
    tok_s: float
    accept_length: float | None = None


def min_tokens(workload: Workload) -> int:
    """The fewest output tokens one concurrency level generates: every repeat sends every prompt,
    each at least its shortest allowed output ("dataset" lengths are the file's: at least 1)."""
    if workload.output_len_source == "fixed":
        shortest = workload.output_len
    elif workload.output_len_source == "uniform":
        shortest = workload.output_len_min or 1
    else:
        shortest = 1
    return workload.num_prompts * workload.repeats * shortest


def pace_problem(workload: Workload, levels: Sequence[Level], elapsed_s: float) -> str | None:
    """Rates too low for the time the lease lasted: its tokens at those rates would need longer."""
    tokens = min_tokens(workload)
    needed = sum(tokens / lv.tok_s for lv in levels if lv.tok_s > 0)
    if min(lv.tok_s for lv in levels) < PACE_CHECKED_BELOW_TOK_S and needed > elapsed_s + PACE_SLACK_S:
        worst = min(levels, key=lambda lv: lv.tok_s)
        return (
            f"at the reported rates ({worst.tok_s:g} tok/s at concurrency {worst.concurrency}) the workload's "
            f"{tokens} tokens per level need {needed:.0f} s, but the lease lasted {elapsed_s:.0f} s"
        )
    return None


def baseline_problem(
    levels: Sequence[Level], peers: Sequence[Mapping[int, float]], own_earlier: Mapping[int, float] | None
) -> str | None:
    """A baseline far off other tokens' baselines of the same key, or its host's own earlier one:
    the same server on another host, or earlier on this one.

    Other tokens speak against it only as a consensus: at least two of them agreeing with each
    other, none near it.  One token's baseline decides nothing about another's: a liar first on a
    study once set the reference (1e6 tok/s) that had both honest hosts quarantined.
    """
    for lv in levels:
        others = [p[lv.concurrency] for p in peers if p.get(lv.concurrency, 0) > 0]
        if len(others) >= 2 and not any(_near(lv.tok_s, o) for o in others):
            ref = statistics.median(others)
            if sum(_near(o, ref) for o in others) >= 2:
                return (
                    f"baseline {lv.tok_s:g} tok/s at concurrency {lv.concurrency} is more than {BASELINE_FACTOR:g}x "
                    f"off the {ref:g} tok/s other hosts measured for the same server and workload"
                )
        if own_earlier is not None and own_earlier.get(lv.concurrency, 0) > 0:
            ref = own_earlier[lv.concurrency]
            if not _near(lv.tok_s, ref):
                return (
                    f"baseline {lv.tok_s:g} tok/s at concurrency {lv.concurrency} is more than {BASELINE_FACTOR:g}x "
                    f"off this host's earlier {ref:g} tok/s for the same server and workload"
                )
    return None


def _near(a: float, b: float) -> bool:
    """Within BASELINE_FACTOR of each other."""
    return 1 / BASELINE_FACTOR <= a / b <= BASELINE_FACTOR


def speedup_problem(config: SpecConfig | None, levels: Sequence[Level], baseline: Mapping[int, float]) -> str | None:
    """A speedup above what the accept length allows, or an accept length above what the steps allow."""
    if config is None:
        return None  # the adaptive proof: its chain is the engine's choice; its speedup the verdict's
    most_accept = config.num_steps + 1
    for lv in levels:
        al = lv.accept_length
        if al is not None and al > most_accept * ACCEPT_OVER_STEPS:
            return (
                f"accept length {al:g} at concurrency {lv.concurrency} is more than {config.num_steps} draft steps "
                f"allow (at most {most_accept} tokens a cycle)"
            )
        base = baseline.get(lv.concurrency)
        if base is None or base <= 0:
            continue
        bound = (al if al is not None and al >= 1 else most_accept) * SPEEDUP_OVER_ACCEPT
        if lv.tok_s / base > bound:
            return (
                f"{lv.tok_s / base:.3g}x the baseline at concurrency {lv.concurrency} is above what an accept length "
                f"of {al if al is not None else most_accept:g} allows (at most {bound:.3g}x)"
            )
    return None
