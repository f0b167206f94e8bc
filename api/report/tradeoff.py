"""The trade-off a user chooses on: per-user tok/s against total tok/s per GPU, across the levels.

Each measured concurrency level of a configuration is one point: how fast each user's tokens
arrive (per-user tok/s) against what the GPUs deliver in total (output tok/s divided by tp_size).
Raising concurrency moves along a curve, down in per-user speed and up in total; speculation
shifts the curve.  Drawn for the baseline (no speculation), the winner and the runner-ups, with
the Pareto front over every point (no other point is better in both), as vLLM's sweep and
aiconfigurator plot it; points over the objective's latency limits are marked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from api.documents import MeasuredLevel, StudyDocument, TrialRow
from api.report.tables import table

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


def _points(levels: Sequence[MeasuredLevel], tp: int, limits: dict[str, float]) -> list[TradeoffPoint]:
    out = []
    for lv in sorted(levels, key=lambda lv: lv.concurrency):
        user, total = lv.per_user_tok_s, lv.output_tok_s
        if user is None:
            continue
        measured = {"itl_ms_p99": lv.itl_ms_p99, "ttft_ms_p99": lv.ttft_ms_p99}
        over = tuple(k for k, v in limits.items() if (got := measured.get(k)) is not None and got > v)
        out.append(TradeoffPoint(lv.concurrency, user, total / tp, over))
    return out


def _config_label(t: TrialRow) -> str:
    c = t.config
    return f"#{t.number} " + ("—" if c is None else f"{c.num_steps}/{c.topk}/{c.num_draft_tokens}")


def series(shown: StudyDocument, trials: Sequence[TrialRow]) -> list[Series]:
    """Baseline, winner and runner-ups (by speedup), each across the levels it measured."""
    tp = max(1, shown.spec.model.tp_size)
    limits = _limits(shown)
    measured = [
        t for t in trials
        if t.state == "COMPLETE" and t.feasible and t.levels and t.speedup is not None and t.duplicate_of is None
    ]  # fmt: skip
    measured.sort(key=lambda t: -(t.speedup or 0.0))
    out: list[Series] = []
    answer = shown.winner
    if answer is not None and answer.adaptive:
        # The answer is the adaptive server: its own launch, not any trial of the search, is the winner.
        if answer.baseline_levels:
            out.append(Series("baseline (no speculation)", "baseline", _points(answer.baseline_levels, tp, limits)))
        out.append(Series("winner: adaptive server", "winner", _points(answer.levels or [], tp, limits)))
        runners = measured
    else:
        winner_no = None if answer is None else answer.trial_number
        winner = next((t for t in measured if t.number == winner_no), measured[0] if measured else None)
        base_levels = (None if winner is None else winner.baseline_levels) or []
        if base_levels:
            out.append(Series("baseline (no speculation)", "baseline", _points(base_levels, tp, limits)))
        if winner is not None:
            label = f"winner {_config_label(winner)}"
            out.append(Series(label, "winner", _points(winner.levels or [], tp, limits)))
        runners = [t for t in measured if t is not winner]
    for t in runners[:RUNNER_UPS]:
        out.append(Series(f"runner-up {_config_label(t)}", "runner-up", _points(t.levels or [], tp, limits)))
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
    return table(["configuration", "level", "tok/s per user", "tok/s per GPU", "front", "over limit"], rows) + note
