"""The report as one HTML file: text, tables and PNG plots inlined as base64 data URIs.

Nothing is loaded from anywhere when the file is opened (no scripts, fonts or images outside
it), so it can be mailed, archived or opened on an air-gapped machine.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from matplotlib.figure import Figure

from api.documents import StudyDocument, TrialRow
from api.report import analysis as an
from api.report import plots, tradeoff
from api.report.source import StudyData
from optimizer.objective import describe, metric_words
from optimizer.sglang import ServerSettings
from spectune_protocol.printable import printable


@dataclass(frozen=True)
class Plot:
    name: str
    title: str
    caption: str
    png: bytes


@dataclass
class Report:
    html: str
    plots: list[Plot] = field(default_factory=list)


def _e(value: Any) -> str:
    # Control characters and bidi overrides as visible escapes first (a worker's failure message
    # may hold them; spectune_protocol.printable is the one escape every output uses), then HTML's.
    return html.escape(printable(str(value), keep_newlines=True))


def _num(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _objective_text(shown: StudyDocument) -> str:
    spec = shown.spec
    level = spec.objective.concurrency
    levels = spec.workload.concurrency
    metric = metric_words(spec.objective)
    if level or len(levels) == 1:
        return f"{metric} speedup at concurrency {level or levels[0]}"
    return f"geometric-mean {metric} speedup over concurrency {', '.join(map(str, levels))}"


def _launched(shown: StudyDocument) -> ServerSettings | None:
    """The server the answer's numbers and command stand for, as launched: the deployment's when it
    runs speculation, else the launch that measured the winner (its confirmation's, where confirmed)."""
    dep = shown.deployment
    if dep is not None and dep.speculation:
        return dep.server
    return None if shown.best is None else shown.best.server


def _graphs(server: ServerSettings | None) -> str:
    if server is None:
        return "not recorded"
    if server.cuda_graph_bs:
        return f"captures {', '.join(map(str, server.cuda_graph_bs))}"
    return str(server.cuda_graph_max_bs) if server.cuda_graph_max_bs is not None else "SGLang's default"


def _plots(data: StudyData, pts: list[an.Point], level: int) -> list[Plot]:
    fit = an.fit_cycle(pts)
    objective = _objective_text(data.shown)
    wanted: list[tuple[str, str, str, Figure]] = []
    # The speedup plot at the level of interest first, then one per other level measured.
    others = [c for c in data.shown.spec.workload.concurrency if c != level]
    for c in [level, *others]:
        at = pts if c == level else an.points(data.trials, int(c))
        if not at:
            continue
        hidden = an.pruned_before(data.trials, int(c))
        wanted.append(
            ("speedup" if c == level else f"speedup-c{c}",
             f"Speedup at concurrency {c} against steps, topk and draft tokens",
             f"Each dot is one configuration's speedup measured at concurrency {c} (not the objective); "
             "hollow circles are pruned trials, stopped after measuring this level; crosses are failed "
             "configurations (their value is the worst seen, a placeholder); the dashed line is the baseline."
             + (f" {hidden} trial(s) pruned before reaching this level are not drawn." if hidden else ""),
             plots.speedup_vs_params(at, int(c)))
        )  # fmt: skip
    if pts:
        wanted += [
            ("acceptance", f"Accept length and per-token accept rate against steps, at concurrency {level}",
             "Accept length alone misleads: each extra step adds less, while the per-token rate "
             "(AL − 1) / (draft tokens − 1) shows how much of the drafting is wasted.",
             plots.acceptance(pts, level)),
            ("cycle", f"Where the cycle time goes, at concurrency {level}",
             "Cycle = accept length / per-user tok/s.  The split is an estimate from the least-squares fit "
             "cycle = a + b·steps + c·draft tokens over the trials: b·steps is drafting, a + c·tokens is "
             "verification and overhead."
             + ("" if fit else " Too few trials (or only topk 1) to fit it: measured cycles only."),
             plots.cycle_split(pts, fit, level)),
            ("history", "Search progress",
             f"The objective ({objective}) of each trial in order, with the best so far; pruned trials "
             "have no objective value and are marked at the bottom.",
             plots.history(pts, objective)),
        ]  # fmt: skip
    if len(an.levels_measured(pts)) > 1:
        wanted.append(
            ("concurrency", "Speedup against concurrency",
             an.best_by_level_text(data.shown.best_by_level) or "The speedup of the best configurations at each level measured.",
             plots.speedup_vs_concurrency(pts))
        )  # fmt: skip
    if any(p.startup_s is not None for p in pts):
        wanted.append(
            ("startup", "Start-up time per configuration",
             "Launch to ready, including CUDA-graph capture: the price of every restart.",
             plots.startup_times(pts))
        )  # fmt: skip
    found = tradeoff.series(data.shown, data.trials)
    if found:
        limits = tradeoff.limits_text(data.shown)
        wanted.append(
            ("tradeoff", "Per-user against per-GPU throughput (the Pareto front)",
             "Each curve is one configuration across the concurrency levels measured (c=…): per-user tok/s "
             "falls and total tok/s per GPU rises with concurrency.  Baseline (no speculation) dashed, the "
             "winner bold, the runner-ups thin; ringed points are the Pareto front (no other point is better "
             "in both).  A confirmed configuration is drawn from its confirmation, any other from its search "
             "launch, and every point is scaled by its own host's baseline onto the baseline drawn, so host "
             "offsets do not move the front" + (f"; crossed points break the objective's latency limits ({limits})." if limits else "."),
             plots.tradeoff(found, tradeoff.pareto(found), limits))
        )  # fmt: skip
    kinds = an.failures_by_kind(data.trials)
    if kinds:
        wanted.append(("failures", "Failures by kind", "Failed configurations and host faults.", plots.failures(kinds)))
    return [Plot(name, title, caption, plots.png(fig)) for name, title, caption, fig in wanted]


def _winner(shown: StudyDocument) -> str:
    best = shown.best
    if best is None:
        return "<p>No configuration has been measured yet.</p>"
    c = best.config
    server = _launched(shown)
    # Every figure says which measurement it is: the confirmation's (next to a fresh baseline) or the search's.
    source = "confirmation" if best.confirmed else "search: measured once, not confirmed"
    rows: list[tuple[str, Any]] = ([("answer", best.label())] if best.adaptive else [("trial", best.trial_number)]) + [
        ("num_steps / topk / num_draft_tokens", f"{c.num_steps} / {c.topk} / {c.num_draft_tokens}"),
        ("cuda_graph_max_bs (as launched)", _graphs(server)),
        ("max_running_requests (as launched)", "not recorded" if server is None else server.max_running_requests),
        (f"speedup (objective; {source})", _num(best.speedup)),
    ]
    if best.confirmed and best.search_speedup is not None:
        rows.append(("speedup in the search (one launch before the confirmation)", _num(best.search_speedup)))
    intervals = best.speedup_interval_by_level
    for level, value in sorted((best.speedup_by_level or {}).items(), key=lambda kv: int(kv[0])):
        iv = intervals.get(level)
        band = f" (95% interval {iv.low:.3f}–{iv.high:.3f})" if iv else " (no interval: fewer than 2 repeats)"
        rows.append((f"speedup at concurrency {level} ({source.split(':')[0]})", f"{value:.3f}{band}"))
    rows += [("measured on", best.worker_id or "—"), ("SGLang", best.sglang_version or "—")]
    if best.lease_id:
        rows.append(("launch (lease)", best.lease_id))
    static = shown.best_static
    if static is not None:
        rows.append(("the best static configuration", f"{static.label()}: {_num(static.speedup)}"))
    table = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    command, note = shown.printed_command(), shown.printed_command_note()
    if command is None:
        return f'<table class="kv">{table}</table><p>No launch command: {_e(note)}</p>'
    said = f" ({_e(note)})" if note else ""
    load = "" if shown.deployment is None else f'<p class="load">{_e(shown.deployment.load_line)}</p>'
    return f'<table class="kv">{table}</table><p>Launch command{said}:</p>{load}<pre class="cmd">{_e(command)}</pre>'


def _trial_table(trials: Sequence[TrialRow], level: int) -> str:
    pts = {p.number: p for p in an.points(trials, level)}
    head = (
        "<tr><th>#</th><th>state</th><th>steps/topk/tokens</th><th>speedup</th><th>accept length</th>"
        "<th>accept rate</th><th>cycle ms</th><th>start-up s</th><th>worker</th><th>failure / note</th></tr>"
    )
    rows = []
    for t in sorted(trials, key=lambda t: t.number):
        c = t.config
        p = pts.get(t.number)
        note = t.failure_kind or ""
        if t.duplicate_of is not None:
            note = f"same configuration as trial {t.duplicate_of}"
        cfg = "—" if c is None else f"{c.num_steps}/{c.topk}/{c.num_draft_tokens}"
        rows.append(
            f"<tr><td>{t.number}</td><td>{_e(t.state)}</td><td>{_e(cfg)}</td>"
            f"<td>{_num(t.speedup)}</td><td>{_num(p.accept_length if p else None, 2)}</td>"
            f"<td>{_num(p.accept_rate if p else None, 2)}</td><td>{_num(p.cycle_ms if p else None, 1)}</td>"
            f"<td>{_num(t.startup_s, 1)}</td><td>{_e(t.worker_id or '—')}</td><td>{_e(note)}</td></tr>"
        )
    return f'<table class="trials">{head}{"".join(rows)}</table>'


CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; padding: 0 1rem; }
h1 { margin-bottom: .2rem; } .sub { color: #555; margin-top: 0; }
.verdict { font-size: 1.15rem; padding: .6rem .9rem; background: #eef5ff; border-left: 4px solid #1f77b4; }
table { border-collapse: collapse; margin: .6rem 0; font-size: .9rem; }
th, td { border: 1px solid #ddd; padding: .25rem .5rem; text-align: left; }
table.kv th { background: #f6f6f6; }
table.trials td:nth-child(n+4):nth-child(-n+8) { text-align: right; font-variant-numeric: tabular-nums; }
pre.cmd { background: #f6f6f6; padding: .7rem; white-space: pre-wrap; word-break: break-all; }
figure { margin: 1.5rem 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #444; font-size: .9rem; }
"""


def _levels_note(shown: StudyDocument, level: int) -> str:
    spec = shown.spec
    levels = spec.workload.concurrency
    if spec.objective.concurrency:
        why = "the objective's level"
    elif len(levels) == 1:
        why = "the only level"
    else:
        why = f"the lowest level; the objective is the geometric mean over {', '.join(map(str, levels))}"
    return f"Plots are drawn at concurrency {level} ({why}) unless their title names another level."


def build_report(data: StudyData, *, generated_at: datetime | None = None) -> Report:
    """Render the study into one HTML document and the plots it embeds."""
    shown = data.shown
    level = an.level_of_interest(shown)
    pts = an.points(data.trials, level)
    figures = _plots(data, pts, level)
    when = (generated_at or datetime.now(UTC)).strftime("%Y-%m-%d %H:%M UTC")
    model = shown.spec.model
    state = shown.state + (f" — {shown.finish_reason}" if shown.finish_reason else "")
    counts = ", ".join(f"{k.lower()} {v}" for k, v in shown.trials.model_dump().items() if v) or "none"
    figure_html = "".join(
        f'<figure id="plot-{p.name}"><h3>{_e(p.title)}</h3>'
        f'<img src="data:image/png;base64,{base64.b64encode(p.png).decode()}" alt="{_e(p.title)}">'
        f"<figcaption>{_e(p.caption)}</figcaption></figure>"
        for p in figures
    )
    doc = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>spectune report: {_e(shown.name)}</title>
<style>{CSS}</style></head><body>
<h1>spectune report: {_e(shown.name)}</h1>
<p class="objective">{_e(describe(shown.spec.objective, shown.spec.workload.concurrency))}</p>
<p class="sub">{_e(model.target)} with draft {_e(model.draft)}, tp {_e(model.tp_size)} ·
state {_e(state)} · trials: {_e(counts)} · generated {when}</p>
<p class="verdict">{_e(shown.verdict)}</p>
<p class="sub">Workload measured: {_e(shown.workload)}</p>
<p class="sub">Cost: {_e(shown.cost.summary)}</p>
<h2>The winner</h2>{_winner(shown)}
<h2>Why</h2>
<p>{_e(_levels_note(shown, level))} {len(pts)} configurations measured at concurrency {level}.</p>
{figure_html or "<p>No measured trials yet.</p>"}
<h2>Every trial</h2>{_trial_table(data.trials, level)}
</body></html>
"""
    return Report(html=doc, plots=figures)
