"""Plain-text tables and progress lines for the CLI (`spectune study list|show|watch`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from api.report import analysis as an


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns, two spaces apart; None shows as a dash."""
    cells = [[("—" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _f(value: float | None, digits: int) -> str | None:
    return None if value is None else f"{value:.{digits}f}"


def study_summary(shown: dict[str, Any]) -> str:
    spec = shown["spec"]
    state = shown["state"] + (f" ({shown['finish_reason']})" if shown.get("finish_reason") else "")
    lines = [
        f"study    {shown['name']}: {spec['model']['target']} + {spec['model']['draft']}, {state}",
        f"verdict  {shown['verdict']}",
    ]
    if shown.get("workload"):
        lines.append(f"workload {shown['workload']}")
    warning = (shown.get("eligibility") or {}).get("warning")
    if warning:
        lines.append(f"WARNING  {warning}")
    base = baselines_line(shown)
    if base:
        lines.append(base)
    best = shown.get("best")
    if best:
        c = best["config"]
        lines.append(
            f"best     trial {best['trial_number']}: steps {c['num_steps']}, topk {c['topk']}, "
            f"draft tokens {c['num_draft_tokens']} -> {best['speedup']:.3f}x"
        )
    dep = shown.get("deployment")
    if dep:
        lines.append(f"deploy   ({dep['mode'].replace('_', ' ')}: {dep['reason']})")
        lines += [f"         {line}" for line in dep["launch_command"].splitlines()]
        if dep.get("load_note"):
            lines.append(f"load     {dep['load_note']}")
        if dep.get("proven_by"):
            lines.append(f"proven   launched exactly as printed by confirmation lease {dep['proven_by']}")
        elif dep.get("proof_note"):
            lines.append(f"proof    {dep['proof_note']}")
    cost = shown.get("cost")
    if cost:
        lines.append(f"cost     {cost['summary']}")
    return "\n".join(lines)


def trials_table(shown: dict[str, Any], trials: list[dict[str, Any]]) -> str:
    level = an.level_of_interest(shown)
    pts = {p.number: p for p in an.points(trials, level)}
    rows = []
    for t in sorted(trials, key=lambda t: t["number"]):
        c = t.get("config") or {}
        p = pts.get(t["number"])
        at: dict[str, Any] = next((lv for lv in t.get("levels") or [] if lv.get("concurrency") == level), {})
        note = trial_note(t)
        rows.append(
            [
                t["number"],
                t["state"],
                f"{c.get('num_steps')}/{c.get('topk')}/{c.get('num_draft_tokens')}" if c else None,
                _f(t.get("speedup"), 3),
                _f(at.get("output_tok_s"), 1),
                _f(p.accept_length if p else None, 2),
                _f(p.accept_rate if p else None, 2),
                _f(at.get("itl_ms_p99"), 1),
                _f(t.get("startup_s"), 1),
                t.get("worker_id"),
                note,
            ]
        )
    headers = ["#", "state", "steps/topk/tok", "speedup", f"tok/s@{level}", "AL", "rate", "itl p99", "start s"]
    return table([*headers, "worker", "note"], rows)


_SOURCES = {"warm_start": "warm start", "prior_study": "from an earlier study", "grid": "grid", "list": "listed"}


def trial_note(t: dict[str, Any]) -> str | None:
    """What the trials table says about a trial beyond its numbers: why it ended, or where it came from."""
    if t.get("duplicate_of") is not None:
        return f"= trial {t['duplicate_of']}"
    if t.get("inferred_from") is not None:
        return f"not launched: OOM like trial {t['inferred_from']}"
    if t.get("failure_kind"):
        return str(t["failure_kind"])
    pruned = t.get("pruned")
    if pruned:
        after = pruned.get("after_concurrency")
        return "pruned" if after is None else f"pruned after c={after}"
    source = t.get("source")
    return _SOURCES.get(str(source), str(source)) if source else None


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


def progress_line(shown: dict[str, Any]) -> str:
    """One line of `study watch`: state, a bar of the trial budget, counts and the best so far."""
    counts = shown["trials"]
    budget = int(shown["spec"]["budget"]["max_trials"])
    launched = int(shown.get("configurations_launched") or 0)
    filled = min(20, round(20 * launched / budget)) if budget else 0
    bar = "#" * filled + "." * (20 - filled)
    best = shown.get("best")
    best_text = f"best {best['speedup']:.3f}x (trial {best['trial_number']})" if best else "no result yet"
    cost = shown.get("cost") or {}
    spent = f"  {cost['launches']} launches, {cost['gpu_hours']:.2f} GPU-h" if cost else ""
    line = (
        f"{shown['state']:<8} [{bar}] {launched}/{budget} launched  complete {counts.get('COMPLETE', 0)}  "
        f"running {counts.get('RUNNING', 0)}  failed {counts.get('FAIL', 0)}  {best_text}{spent}"
    )
    warning = (shown.get("eligibility") or {}).get("warning")
    return line if not warning else f"{line}\n          WARNING: {warning}"


def levels_table(shown: dict[str, Any]) -> str:
    """One row per concurrency level: baseline tok/s per host, the best configuration there, the winner's speedup."""
    levels = [int(c) for c in shown["spec"]["workload"]["concurrency"]]
    best = shown.get("best_by_level") or {}
    winner = shown.get("winner") or {}
    w_by_level = winner.get("speedup_by_level") or {}
    baselines = shown.get("baselines") or []
    rows = []
    for level in levels:
        base = [b["tok_s"].get(str(level)) for b in baselines if b["tok_s"].get(str(level)) is not None]
        a = best.get(str(level))
        c = (a or {}).get("config") or {}
        iv = (a or {}).get("speedup_interval")
        rows.append(
            [
                level,
                " / ".join(f"{v:.1f}" for v in base) or None,
                f"{c['num_steps']}/{c['topk']}/{c['num_draft_tokens']} (#{a['trial_number']})" if a else None,
                _f((a or {}).get("speedup"), 3),
                f"{iv['low']:.3f}-{iv['high']:.3f}" if iv else None,
                _f(w_by_level.get(str(level)), 3),
            ]
        )
    headers = ["level", "baseline tok/s", "best here", "speedup", "95% interval", "winner"]
    return table(headers, rows)


def baselines_line(shown: dict[str, Any]) -> str | None:
    """Each host's latest baseline (no speculation), the denominator of every speedup."""
    parts = []
    for b in shown.get("baselines") or []:
        per = ", ".join(f"{v:.1f} tok/s @{k}" for k, v in sorted(b["tok_s"].items(), key=lambda kv: int(kv[0])))
        parts.append(f"{b['worker_id']}: {per}")
    return "baseline " + "; ".join(parts) if parts else None


def failures_table(trials: list[dict[str, Any]], width: int = 100) -> str | None:
    """Why each failed or pruned trial ended, one line each."""
    rows = []
    for t in sorted(trials, key=lambda t: t["number"]):
        if t.get("failure_kind"):
            rows.append([t["number"], t["failure_kind"], shorten(str(t.get("failure_message") or ""), width)])
        elif t.get("pruned"):
            # The reason whole: it is one sentence that says why (it was cut mid-sentence at 100).
            rows.append([t["number"], "pruned", " ".join(str(t["pruned"].get("reason") or "").split())])
    return table(["#", "why", "message"], rows) if rows else None
