"""Plain-text tables and progress lines for the CLI (`spectune study list|show|watch`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from api.documents import StudyDocument, TrialRow
from api.outcomes import headline
from api.report import analysis as an
from optimizer.space import SpecConfig


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns, two spaces apart; None shows as a dash."""
    cells = [[("—" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _f(value: float | None, digits: int) -> str | None:
    return None if value is None else f"{value:.{digits}f}"


def _config(c: SpecConfig) -> str:
    return f"{c.num_steps}/{c.topk}/{c.num_draft_tokens}"


def study_summary(shown: StudyDocument) -> str:
    model = shown.spec.model
    state = shown.state + (f" ({shown.finish_reason})" if shown.finish_reason else "")
    lines = [
        # The outcome first, the line a reader (and `study best`'s exit status) acts on.
        f"answer   {headline(shown)}",
        f"study    {shown.name}: {model.target} + {model.draft}, {state}",
        f"verdict  {shown.verdict}",
    ]
    lines.append(f"workload {shown.workload}")
    if shown.objective:
        lines.append(f"judged   by {shown.objective.removeprefix('objective: ')}")
    warning = None if shown.eligibility is None else shown.eligibility.warning
    if warning:
        lines.append(f"WARNING  {warning}")
    base = baselines_line(shown)
    if base:
        lines.append(base)
    best = shown.best
    if best:
        iv = best.speedup_interval
        band = f" [{iv.low:.3f}-{iv.high:.3f}]" if iv else ""
        measured = "confirmation" if best.confirmed else "search, not confirmed"
        lines.append(f"best     {best.label()} -> {best.speedup or 0.0:.3f}x{band} ({measured})")
        if best.confirmed:
            # One record: the launch the answer's numbers come from (issue 17 item 5).
            lines.append(f"         measured by lease {best.lease_id} on {best.confirmed_on}")
    static = shown.best_static
    if static:
        lines.append(f"static   the best static configuration: {static.label()} -> {static.speedup or 0.0:.3f}x")
    dep = shown.deployment
    if dep:
        lines.append(f"deploy   ({dep.mode.replace('_', ' ')}: {dep.reason})")
        # The load it was proven at right above the command, where it is copied from.
        lines.append(f"load     {dep.load_line}")
        lines += [f"         {line}" for line in dep.launch_command.splitlines()]
        if dep.load_note:
            lines.append(f"note     {dep.load_note}")
        if dep.proven_by:
            lines.append(f"proven   launched exactly as printed by confirmation lease {dep.proven_by}")
        elif dep.proof_note:
            lines.append(f"proof    {dep.proof_note}")
    lines.append(f"cost     {shown.cost.summary}")
    return "\n".join(lines)


def trials_table(shown: StudyDocument, trials: Sequence[TrialRow]) -> str:
    level = an.level_of_interest(shown)
    pts = {p.number: p for p in an.points(trials, level)}
    rows = []
    for t in sorted(trials, key=lambda t: t.number):
        p = pts.get(t.number)
        at = next((lv for lv in t.levels or [] if lv.concurrency == level), None)
        note = trial_note(t)
        rows.append(
            [
                t.number,
                t.state,
                None if t.config is None else _config(t.config),
                _f(t.speedup, 3),
                _f(None if at is None else at.output_tok_s, 1),
                _f(p.accept_length if p else None, 2),
                _f(p.accept_rate if p else None, 2),
                _f(None if at is None else at.itl_ms_p99, 1),
                _f(t.startup_s, 1),
                t.worker_id,
                note,
            ]
        )
    headers = ["#", "state", "steps/topk/tok", "speedup", f"tok/s@{level}", "AL", "rate", "itl p99", "start s"]
    return table([*headers, "worker", "note"], rows)


_SOURCES = {"warm_start": "warm start", "prior_study": "from an earlier study", "grid": "grid", "list": "listed"}


def trial_note(t: TrialRow) -> str | None:
    """What the trials table says about a trial beyond its numbers: why it ended, or where it came from."""
    if t.duplicate_of is not None:
        return f"= trial {t.duplicate_of}"
    if t.inferred_from is not None:
        return f"not launched: OOM like trial {t.inferred_from}"
    if t.failure_kind:
        return t.failure_kind
    if t.pruned:
        return f"pruned after c={t.pruned.after_concurrency}"
    return _SOURCES.get(t.source, t.source) if t.source else None


def shorten(text: str, width: int) -> str:
    """`text` in at most `width` characters: whole sentences, else whole words, marked with '…'."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    head = text[: width - 1]
    end = max(head.rfind(". "), head.rfind("; "))
    if end > width // 2:
        return head[: end + 1] + " …"
    space = head.rfind(" ")
    return (head[:space] if space > width // 2 else head) + "…"


def progress_line(shown: StudyDocument) -> str:
    """One line of `study watch`: state, a bar of the trial budget, counts and the best so far."""
    counts = shown.trials
    budget = shown.spec.budget.max_trials
    launched = shown.configurations_launched
    filled = min(20, round(20 * launched / budget)) if budget else 0
    bar = "#" * filled + "." * (20 - filled)
    best = shown.best
    what = "adaptive server" if best and best.adaptive else f"trial {best.trial_number}" if best else ""
    best_text = f"best {best.speedup or 0.0:.3f}x ({what})" if best else "no result yet"
    cost = shown.cost
    spent = f"  {cost.launches} launches, {cost.gpu_hours:.2f} GPU-h"
    line = (
        f"{shown.state:<8} [{bar}] {launched}/{budget} launched  complete {counts.COMPLETE}  "
        f"running {counts.RUNNING}  failed {counts.FAIL}  {best_text}{spent}"
    )
    warning = None if shown.eligibility is None else shown.eligibility.warning
    return line if not warning else f"{line}\n          WARNING: {warning}"


def levels_table(shown: StudyDocument) -> str:
    """One row per concurrency level: baseline tok/s per host, the best configuration there, the winner's speedup."""
    w_by_level = (None if shown.winner is None else shown.winner.speedup_by_level) or {}
    rows = []
    for level in shown.spec.workload.concurrency:
        base = [b.tok_s[str(level)] for b in shown.baselines if b.tok_s.get(str(level)) is not None]
        a = shown.best_by_level.get(str(level))
        iv = None if a is None else a.speedup_interval
        rows.append(
            [
                level,
                " / ".join(f"{v:.1f}" for v in base) or None,
                None if a is None else f"{_config(a.config)} (#{a.trial_number})",
                _f(None if a is None else a.speedup, 3),
                f"{iv.low:.3f}-{iv.high:.3f}" if iv else None,
                _f(w_by_level.get(str(level)), 3),
            ]
        )
    headers = ["level", "baseline tok/s", "best here", "speedup", "95% interval", "winner"]
    return table(headers, rows)


def baselines_line(shown: StudyDocument) -> str | None:
    """Each host's latest baseline (no speculation), the denominator of every speedup."""
    parts = []
    for b in shown.baselines:
        per = ", ".join(f"{v:.1f} tok/s @{k}" for k, v in sorted(b.tok_s.items(), key=lambda kv: int(kv[0])))
        parts.append(f"{b.worker_id}: {per}")
    return "baseline " + "; ".join(parts) if parts else None


def failures_table(trials: Sequence[TrialRow], width: int = 100) -> str | None:
    """Why each failed or pruned trial ended, one line each."""
    rows: list[list[Any]] = []
    for t in sorted(trials, key=lambda t: t.number):
        if t.failure_kind:
            rows.append([t.number, t.failure_kind, shorten(t.failure_message or "", width)])
        elif t.pruned:
            # The reason whole: it is one sentence that says why (it was cut mid-sentence at 100).
            rows.append([t.number, "pruned", " ".join(t.pruned.reason.split())])
    return table(["#", "why", "message"], rows) if rows else None
