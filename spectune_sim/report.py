"""The per-landscape optimum table printed by `python -m spectune_sim.landscapes`."""

from __future__ import annotations

import sys
from typing import TextIO

from spectune_sim.landscapes import LANDSCAPES, Landscape
from spectune_sim.model import ConfigSpace, check_memory, predict, startup_seconds, true_optimum
from spectune_sim.rules import DraftLike, DraftTree, TreeGrid

CONCURRENCY_LEVELS = (1, 4, 16, 64)


def landscape_report(
    landscape: Landscape, space: ConfigSpace[DraftLike], levels: tuple[int, ...] = CONCURRENCY_LEVELS
) -> str:
    """Baseline, true optimum per level and calibration rows of one landscape, as text."""
    # One server serves every level of a study, so max running requests = the largest level.
    r = max(levels)
    n_configs = sum(1 for _ in space.iter_configs())
    n_oom = sum(1 for c in space.iter_configs() if not check_memory(landscape, c, max_running_requests=r).ok)
    lines = [
        f"## {landscape.name}: {landscape.summary}",
        f"   modelled on {landscape.modelled_on}; host {landscape.host}",
        f"   default space: {n_configs} configurations, {n_oom} OOM at start-up (max running requests {r})",
        f"   {'conc':>4}  {'baseline tok/s':>14}  {'optimum':<18} {'tok/s':>9}  {'speedup':>7}  {'AL':>5}  {'start-up':>8}",
    ]
    for level in levels:
        base = predict(landscape, None, level, max_running_requests=r)
        config, speedup = true_optimum(landscape, space, level, max_running_requests=r)
        p = predict(landscape, config, level, max_running_requests=r)
        start = startup_seconds(landscape, config, max_running_requests=r)
        key = f"{config.num_steps}/{config.topk}/{config.num_draft_tokens}"
        lines.append(
            f"   {level:>4}  {base.output_tok_s:>14.1f}  {key:<18} {p.output_tok_s:>9.1f}  {speedup:>7.3f}  "
            f"{p.accept_length:>5.2f}  {start:>7.0f}s"
        )
    if landscape.calibration:
        lines.append("   calibration (batch size 1): steps/topk/ndt  model tok/s  published  error")
        for point in landscape.calibration:
            spec = None if point.num_steps is None else DraftTree(point.num_steps, point.topk, point.num_draft_tokens)
            model = predict(landscape, spec, 1).output_tok_s
            err = model / point.published_tok_s - 1.0
            lines.append(
                f"     {point.label:<24} {model:>9.1f}  {point.published_tok_s:>9.1f}  {err:>+6.1%}   {point.source}"
            )
    return "\n".join(lines)


def main(out: TextIO = sys.stdout) -> None:
    space = TreeGrid()
    out.write(
        "Simulated landscapes: true optimum over the default search space (steps 1-10, topk 1/2/4/8, ndt 2-64)\n\n"
    )
    for landscape in LANDSCAPES.values():
        out.write(landscape_report(landscape, space) + "\n\n")
