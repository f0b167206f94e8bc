"""The report's figures, drawn with matplotlib's Agg renderer into PNG bytes.

`Figure` objects are used directly (never pyplot), so there is no global figure state and no
display backend: this runs on a headless API host or in a worker thread.
"""

from __future__ import annotations

import io
from collections import Counter

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from api.report.analysis import CycleFit, Point
from api.report.tradeoff import Series

DPI = 110
FEASIBLE, INFEASIBLE, BEST, GRID, PRUNED = "#1f77b4", "#d62728", "#ff7f0e", "#dddddd", "#7f7f7f"
TOPK_COLORS = {1: "#1f77b4", 2: "#2ca02c", 4: "#9467bd", 8: "#8c564b"}


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return buf.getvalue()


def _best(pts: list[Point]) -> Point | None:
    feasible = [p for p in pts if p.feasible and not p.pruned]
    return max(feasible, key=lambda p: p.speedup) if feasible else None


def speedup_vs_params(pts: list[Point], level: int) -> Figure:
    """Speedup measured at concurrency `level` (not the objective) against each parameter."""
    fig = Figure(figsize=(12, 3.8))
    best = _best(pts)
    for ax, attr, name in zip(
        fig.subplots(1, 3, sharey=True),
        ("steps", "topk", "draft_tokens"),
        ("num_steps", "topk", "num_draft_tokens"),
        strict=True,
    ):
        ok = [p for p in pts if p.feasible and not p.pruned]
        bad = [p for p in pts if not p.feasible]
        cut = [p for p in pts if p.pruned and p.feasible]
        ax.scatter([getattr(p, attr) for p in ok], [p.speedup for p in ok], c=FEASIBLE, label="measured", zorder=3)
        if cut:
            ax.scatter([getattr(p, attr) for p in cut], [p.speedup for p in cut], facecolors="none",
                       edgecolors=PRUNED, label="pruned (stopped after this level)", zorder=3)  # fmt: skip
        if bad:
            ax.scatter([getattr(p, attr) for p in bad], [p.speedup for p in bad], c=INFEASIBLE, marker="x",
                       label="failed (placeholder value)", zorder=3)  # fmt: skip
        if best is not None:
            ax.scatter([getattr(best, attr)], [best.speedup], c=BEST, marker="*", s=260,
                       label=f"best at concurrency {level}", zorder=4)  # fmt: skip
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="baseline")
        ax.set_xlabel(name)
        if attr == "topk":
            ax.set_xscale("log", base=2)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(color=GRID)
    fig.axes[0].set_ylabel(f"speedup at concurrency {level}")
    fig.axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"Speedup over the baseline at concurrency {level}, against each parameter")
    return fig


def acceptance(pts: list[Point], level: int) -> Figure:
    fig = Figure(figsize=(12, 3.8))
    ax_al, ax_rate = fig.subplots(1, 2)
    with_al = [p for p in pts if p.accept_length is not None]
    for topk in sorted({p.topk for p in with_al}):
        group = sorted((p for p in with_al if p.topk == topk), key=lambda p: p.steps)
        color = TOPK_COLORS.get(topk, "black")
        ax_al.plot([p.steps for p in group], [p.accept_length for p in group], "o", color=color, label=f"topk {topk}")
        ax_rate.plot([p.steps for p in group], [p.accept_rate for p in group], "o", color=color, label=f"topk {topk}")
    ax_al.set_title(f"Accept length (tokens per verify cycle) at concurrency {level}")
    ax_al.set_xlabel("num_steps")
    ax_al.set_ylabel("accept length")
    ax_rate.set_title("Per-token accept rate (AL − 1) / (draft tokens − 1)")
    ax_rate.set_xlabel("num_steps")
    ax_rate.set_ylabel("accept rate")
    ax_rate.set_ylim(0, 1.05)
    for ax in (ax_al, ax_rate):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(color=GRID)
        if with_al:
            ax.legend(fontsize=8)
    return fig


def cycle_split(pts: list[Point], fit: CycleFit | None, level: int) -> Figure:
    measured = sorted(
        (p for p in pts if p.feasible and p.cycle_ms is not None), key=lambda p: (p.steps, p.draft_tokens)
    )
    fig = Figure(figsize=(12, 4.2))
    ax = fig.subplots()
    x = list(range(len(measured)))
    cycles = [p.cycle_ms or 0.0 for p in measured]
    if fit is not None:
        draft = [max(fit.draft_ms(p), 0.0) for p in measured]
        verify = [max(fit.verify_ms(p), 0.0) for p in measured]
        ax.bar(
            x,
            verify,
            color="#9ecae1",
            label=f"verify + overhead ≈ {fit.overhead_ms:.1f} + {fit.verify_token_ms:.2f}·tokens ms",
        )
        ax.bar(x, draft, bottom=verify, color="#fdae6b", label=f"draft ≈ {fit.draft_step_ms:.2f} ms × steps")
        ax.set_title(
            f"Cycle time split at concurrency {level} (least-squares fit over {fit.n} trials, R² = {fit.r2:.2f})"
        )
    else:
        ax.bar(x, cycles, color="#bdbdbd", label="measured cycle (too few trials to split)")
        ax.set_title(f"Cycle time per configuration at concurrency {level}")
    ax.plot(x, cycles, "k.", label="measured cycle = AL / per-user tok/s")
    ax.set_xticks(x, [p.label for p in measured], rotation=60, fontsize=8)
    ax.set_xlabel("configuration (steps/topk/draft tokens)")
    ax.set_ylabel("ms per cycle")
    ax.legend(fontsize=8)
    ax.grid(axis="y", color=GRID)
    return fig


def speedup_vs_concurrency(pts: list[Point], top: int = 6) -> Figure:
    fig = Figure(figsize=(8, 4.2))
    ax = fig.subplots()
    ranked = sorted(
        (p for p in pts if p.feasible and not p.pruned and len(p.speedup_by_level) > 1),
        key=lambda p: -(p.objective or 0.0),
    )[:top]
    for p in ranked:
        levels = sorted(p.speedup_by_level)
        ax.plot(levels, [p.speedup_by_level[c] for c in levels], "o-", label=f"#{p.number} {p.label}")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("speedup")
    ax.set_title(f"Speedup against concurrency (the {len(ranked)} best by the objective)")
    ax.legend(fontsize=8)
    ax.grid(color=GRID)
    return fig


def startup_times(pts: list[Point]) -> Figure:
    timed = sorted((p for p in pts if p.startup_s is not None), key=lambda p: p.startup_s or 0.0)
    fig = Figure(figsize=(8, max(2.5, 0.28 * len(timed) + 1)))
    ax = fig.subplots()
    ax.barh([f"#{p.number} {p.label}" for p in timed], [p.startup_s or 0.0 for p in timed], color="#74c476")
    ax.set_xlabel("server start-up (s): launch to ready, CUDA-graph capture included")
    ax.set_title("Start-up time per configuration")
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="x", color=GRID)
    return fig


def failures(kinds: Counter[str]) -> Figure:
    fig = Figure(figsize=(7, 3.2))
    ax = fig.subplots()
    names = sorted(kinds)
    ax.bar(names, [kinds[k] for k in names], color=INFEASIBLE)
    ax.set_ylabel("trials")
    ax.set_title("Failures by kind")
    ax.grid(axis="y", color=GRID)
    return fig


def history(pts: list[Point], objective: str) -> Figure:
    """The objective value of each trial in order (pruned trials, which have none, as ticks at the bottom)."""
    ordered = sorted((p for p in pts if p.objective is not None), key=lambda p: p.number)
    fig = Figure(figsize=(8, 3.6))
    ax = fig.subplots()
    ax.scatter([p.number for p in ordered], [p.objective or 0.0 for p in ordered],
               c=[FEASIBLE if p.feasible else INFEASIBLE for p in ordered], zorder=3)  # fmt: skip
    best_so_far, running = [], float("-inf")
    for p in ordered:
        if p.feasible and p.objective is not None:
            running = max(running, p.objective)
        best_so_far.append(running if running > float("-inf") else float("nan"))
    ax.step([p.number for p in ordered], best_so_far, where="post", color=BEST, label="best so far")
    cut = sorted({p.number for p in pts if p.pruned})
    if cut:
        ax.plot(
            cut, [0.0] * len(cut), "|", color=PRUNED, markersize=14, label="pruned", transform=ax.get_xaxis_transform()
        )
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel(objective)
    ax.set_title("Search progress")
    ax.legend(fontsize=8)
    ax.grid(color=GRID)
    return fig


def tradeoff(all_series: list[Series], front: set[tuple[str, int]], limits: str | None) -> Figure:
    """Per-user tok/s (x) against total tok/s per GPU (y), one curve per configuration across its
    levels (labelled by concurrency); the Pareto front ringed; levels over a latency limit crossed."""
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    styles = {"baseline": ("k--", 1.5), "winner": ("-", 2.5), "runner-up": ("-", 1.0)}
    for s in all_series:
        fmt, width = styles[s.role]
        xs = [p.per_user_tok_s for p in s.points]
        ys = [p.tok_s_per_gpu for p in s.points]
        (line,) = ax.plot(xs, ys, fmt, marker="o", linewidth=width, label=s.label)
        for p in s.points:
            ax.annotate(f"c={p.concurrency}", (p.per_user_tok_s, p.tok_s_per_gpu), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))  # fmt: skip
            if p.over_limits:
                ax.plot([p.per_user_tok_s], [p.tok_s_per_gpu], "x", color=INFEASIBLE, markersize=11, mew=2)
            if (s.label, p.concurrency) in front:
                ax.plot([p.per_user_tok_s], [p.tok_s_per_gpu], "o", mfc="none", mec=BEST, markersize=13, mew=2)
    ax.set_xlabel("tok/s per user (each request's decode speed)")
    ax.set_ylabel("total output tok/s per GPU")
    title = "Per-user against per-GPU throughput across the measured levels"
    ax.set_title(title if not limits else f"{title}\n(latency limits: {limits}; x = over a limit)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(color=GRID)
    return fig
