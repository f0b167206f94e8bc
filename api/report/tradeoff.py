"""The trade-off a user chooses on: per-user tok/s against total tok/s per GPU, across the levels.

Each measured concurrency level of a configuration is one point: how fast each user's tokens
arrive (per-user tok/s) against what the GPUs deliver in total (output tok/s divided by tp_size).
Raising concurrency moves along a curve, down in per-user speed and up in total; speculation
shifts the curve.  Drawn for the baseline (no speculation), the winner and the runner-ups, with
the Pareto front over every point (no other point is better in both), as vLLM's sweep and
aiconfigurator plot it; points over the objective's latency limits are marked.

One result, one set of numbers: a configuration a confirmation re-measured is drawn from that
confirmation (its levels and the fresh baseline paired with it), any other from its search
launch; and since those ran on hosts whose baselines differ, every point is scaled by its own
host's baseline onto the reference baseline drawn (the winner's): a point reads "what this
configuration gives on the reference host", so the front compares speedups, never host offsets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from api.documents import MeasuredLevel, StudyDocument, TrialRow
from api.report.tables import table
from optimizer.objective import describe

RUNNER_UPS = 2


@dataclass(frozen=True)
class TradeoffPoint:
    concurrency: int
    per_user_tok_s: float
    tok_s_per_gpu: float
    # Which of the objective's latency limits this level breaks ([]: none, or no limits).
    over_limits: tuple[str, ...] = ()


@dataclass
class Series:
    label: str
    role: str  # baseline | winner | runner-up
    points: list[TradeoffPoint] = field(default_factory=list)
    # Where the numbers come from: "confirmation" (re-measured next to a fresh baseline) or "search".
    source: str = "search"


def _limits(shown: StudyDocument) -> dict[str, float]:
    objective = shown.spec.objective
    out = {}
    if objective.max_p99_itl_ms is not None:
        out["itl_ms_p99"] = objective.max_p99_itl_ms
    if objective.max_p99_ttft_ms is not None:
        out["ttft_ms_p99"] = objective.max_p99_ttft_ms
    return out


def limits_text(shown: StudyDocument) -> str | None:
    names = {"itl_ms_p99": "ITL p99", "ttft_ms_p99": "TTFT p99"}
    parts = [f"{names[k]} <= {v:g} ms" for k, v in _limits(shown).items()]
    return " and ".join(parts) or None


def _points(
    levels: Sequence[MeasuredLevel],
    tp: int,
    limits: dict[str, float],
    own_base: Sequence[MeasuredLevel] | None = None,
    ref_base: Sequence[MeasuredLevel] | None = None,
) -> list[TradeoffPoint]:
    """The levels as points; with `own_base` (the baseline measured on the same host) scaled onto
    `ref_base` level by level, each axis by its own baseline figure.  A level either baseline
    lacks cannot be put on the reference scale and is left out."""
    scale = _scales(own_base, ref_base)
    out = []
    for lv in sorted(levels, key=lambda lv: lv.concurrency):
        user, total = lv.per_user_tok_s, lv.output_tok_s
        if user is None:
            continue
        if scale is not None:
            if lv.concurrency not in scale:
                continue
            user, total = user * scale[lv.concurrency][0], total * scale[lv.concurrency][1]
        measured = {"itl_ms_p99": lv.itl_ms_p99, "ttft_ms_p99": lv.ttft_ms_p99}
        over = tuple(k for k, v in limits.items() if (got := measured.get(k)) is not None and got > v)
        out.append(TradeoffPoint(lv.concurrency, user, total / tp, over))
    return out


def _scales(
    own: Sequence[MeasuredLevel] | None, ref: Sequence[MeasuredLevel] | None
) -> dict[int, tuple[float, float]] | None:
    """Per level, (per-user, output) factors from the own host's baseline to the reference's."""
    if own is None or ref is None:
        return None
    mine = {b.concurrency: b for b in own}
    out = {}
    for r in ref:
        b = mine.get(r.concurrency)
        if b is None or not b.per_user_tok_s or not r.per_user_tok_s or b.output_tok_s <= 0:
            continue
        out[r.concurrency] = (r.per_user_tok_s / b.per_user_tok_s, r.output_tok_s / b.output_tok_s)
    return out


def _config_label(t: TrialRow) -> str:
    c = t.config
    return f"#{t.number} " + ("—" if c is None else f"{c.num_steps}/{c.topk}/{c.num_draft_tokens}")


Numbers = tuple[list[MeasuredLevel], list[MeasuredLevel], str]


def _numbers(shown: StudyDocument, t: TrialRow) -> Numbers:
    """(levels, the same host's baseline levels, "confirmation" | "search") a trial is drawn with:
    its latest completed confirmation's where one re-measured it, else its search launch's."""
    for c in shown.confirmation or []:
        if c.trial_number == t.number and not c.adaptive and c.state == "completed" and c.levels and c.baseline_levels:
            return list(c.levels), list(c.baseline_levels), "confirmation"
    return list(t.levels or []), list(t.baseline_levels or []), "search"


def series(shown: StudyDocument, trials: Sequence[TrialRow]) -> list[Series]:
    """Baseline, winner and runner-ups (by speedup), each across the levels it measured, on the
    reference baseline's scale (the winner's own: its confirmation's where it was confirmed)."""
    tp = max(1, shown.spec.model.tp_size)
    limits = _limits(shown)
    measured = [
        t for t in trials
        if t.state == "COMPLETE" and t.feasible and t.levels and t.speedup is not None and t.duplicate_of is None
    ]  # fmt: skip
    measured.sort(key=lambda t: -(t.speedup or 0.0))
    out: list[Series] = []
    answer = shown.winner
    ref: list[MeasuredLevel] = []
    if answer is not None and answer.adaptive:
        # The answer is the adaptive server: its own launch, not any trial of the search, is the winner.
        ref = list(answer.baseline_levels or [])
        if ref:
            out.append(Series("baseline (no speculation)", "baseline", _points(ref, tp, limits), "confirmation"))
        out.append(
            Series("winner: adaptive server", "winner", _points(answer.levels or [], tp, limits), "confirmation")
        )
        runners = measured
    else:
        # The document's winner (optimizer.answer.winner), never a winner of the plot's own: without
        # one among the measured trials, they are all runner-ups.
        winner_no = None if answer is None else answer.trial_number
        winner = next((t for t in measured if t.number == winner_no), None)
        if winner is not None:
            levels, ref, source = _numbers(shown, winner)
            if ref:
                out.append(Series("baseline (no speculation)", "baseline", _points(ref, tp, limits), source))
            out.append(Series(f"winner {_config_label(winner)}", "winner", _points(levels, tp, limits), source))
        runners = [t for t in measured if t is not winner]
    for t in runners[:RUNNER_UPS]:
        levels, own, source = _numbers(shown, t)
        points = _points(levels, tp, limits, own, ref) if ref and own else _points(levels, tp, limits)
        out.append(Series(f"runner-up {_config_label(t)}", "runner-up", points, source))
    return [s for s in out if s.points]


def pareto(all_series: Sequence[Series]) -> set[tuple[str, int]]:
    """(series label, concurrency) of the points no other point beats in both per-user and per-GPU tok/s.

    Points over a latency limit are not candidates: they are not a choice the user can make.
    """
    pts = [(s.label, p) for s in all_series for p in s.points if not p.over_limits]
    front = set()
    for label, p in pts:
        dominated = any(
            q.per_user_tok_s >= p.per_user_tok_s
            and q.tok_s_per_gpu >= p.tok_s_per_gpu
            and (q.per_user_tok_s > p.per_user_tok_s or q.tok_s_per_gpu > p.tok_s_per_gpu)
            for _, q in pts
        )
        if not dominated:
            front.add((label, p.concurrency))
    return front


def tradeoff_table(shown: StudyDocument, trials: Sequence[TrialRow]) -> str | None:
    """`study show`'s text form: one row per configuration and level; `*` marks the Pareto front."""
    found = series(shown, trials)
    if not found:
        return None
    front = pareto(found)
    rows = [
        [
            s.label,
            s.source,
            p.concurrency,
            f"{p.per_user_tok_s:.1f}",
            f"{p.tok_s_per_gpu:.1f}",
            "*" if (s.label, p.concurrency) in front else None,
            ", ".join(p.over_limits) or None,
        ]
        for s in found
        for p in s.points
    ]
    limits = limits_text(shown)
    note = f"\n(latency limits: {limits}; a level over one is not on the front)" if limits else ""
    head = f"{describe(shown.spec.objective, shown.spec.workload.concurrency)}; every point scaled by its own host's baseline onto the baseline shown\n"
    columns = ["configuration", "measured in", "level", "tok/s per user", "tok/s per GPU", "front", "over limit"]
    return head + table(columns, rows) + note
