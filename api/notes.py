"""The study note optuna-dashboard shows: spec, baseline, best so far and verdict, in markdown.

optuna-dashboard keeps notes as study system attrs (`optuna_dashboard.save_note`).  The note is
rewritten only when its text changed, so refreshing it on every dashboard poll costs one read.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import optuna
from optuna_dashboard import get_note, save_note
from sqlalchemy import select

from api.context import ServiceContext
from api.documents import StudyDocument
from api.models import BaselineRow, StudyRow
from api.services.studies import StudyService
from optimizer.errors import StudyNotFoundError
from optimizer.objective import describe
from optimizer.spec import Objective
from spectune_protocol.printable import printable

log = logging.getLogger("spectune.api.notes")


# Markdown's own characters: escaped in text a worker's report may carry (finish_reason and
# verdict quote it), so a forged "[click](https://...)" shows as typed and never renders a link.
_MARKDOWN = re.compile(r"([\\`*_{}\[\]()<>#+\-.!|~])")


def md_plain(text: str) -> str:
    """`text` as plain text inside the markdown note: control characters and markdown escaped."""
    return _MARKDOWN.sub(r"\\\1", printable(text))


def _fmt(x: Any, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def baseline_lines(ctx: ServiceContext, baseline_key: str) -> list[str]:
    """One line per host: its latest baseline output tok/s at each concurrency level."""
    with ctx.sessions() as s:
        rows = s.scalars(
            select(BaselineRow).where(BaselineRow.baseline_key == baseline_key).order_by(BaselineRow.measured_at)
        ).all()
    latest = {row.worker_id: row for row in rows}
    lines = []
    for worker, row in sorted(latest.items()):
        levels = ", ".join(
            f"c={c}: {float(v):.1f} tok/s" for c, v in sorted(row.tok_s.items(), key=lambda kv: int(kv[0]))
        )
        lines.append(f"- `{worker}` ({row.measured_at:%Y-%m-%d %H:%M} UTC): {levels}")
    return lines


def objective_text(objective: Objective, levels: Sequence[int] = ()) -> str:
    text = describe(objective, levels).removeprefix("objective: ")
    limits = [
        f"{k.removeprefix('max_')} ≤ {v}"
        for k, v in objective.model_dump().items()
        if k.startswith("max_") and v is not None and objective.name != "goodput"  # goodput's own SLO: said above
    ]
    return text + (f" with {', '.join(limits)}" if limits else "")


def render_note(shown: StudyDocument, baselines: list[str]) -> str:
    """The markdown note for a study, from its document and the baseline lines."""
    spec = shown.spec
    model, space = spec.model, spec.search_space
    counts = shown.trials.model_dump()
    out = [
        f"# {shown.name}",
        "",
        f"**Objective:** {objective_text(spec.objective, spec.workload.concurrency)}",
        "",
        f"**State:** {shown.state}" + (f" — {md_plain(shown.finish_reason)}" if shown.finish_reason else ""),
        "",
        f"**Verdict:** {md_plain(shown.verdict)}",
        "",
        "## Spec",
        f"- model `{model.target}`, draft `{model.draft}`, tp {model.tp_size}, "
        f"attention backend `{model.attention_backend}`",
        f"- search: steps {space.num_steps.low}–{space.num_steps.high}, topk {space.topk}, "
        f"draft tokens {space.num_draft_tokens.low}–{space.num_draft_tokens.high}",
        # The workload's real lengths, as the study document states them (a dataset's, a range's).
        f"- workload: {shown.workload}",
        f"- sampler `{spec.sampler}`",
        "- budget: " + ", ".join(f"{k} {v}" for k, v in spec.budget.model_dump().items() if v is not None),
        "",
        "## Baseline (no speculation)",
        *(baselines or ["- not measured yet"]),
        "",
        "## Trials",
        "- " + ", ".join(f"{k.lower()} {v}" for k, v in counts.items() if v) if any(counts.values()) else "- none yet",
        "",
        "## Best so far",
    ]
    best = shown.best
    if best is None:
        out.append("- none yet")
    else:
        measured = "confirmation" if best.confirmed else "search, not confirmed"
        out.append(f"- {best.label()} → **{_fmt(best.speedup)}×** the baseline ({measured})")
        for level, iv in best.speedup_interval_by_level.items():
            out.append(f"- concurrency {level}: 95% interval {iv.low:.3f}–{iv.high:.3f}")
        if best.confirmed:
            # One record: the launch the answer's numbers come from (issue 17 item 5).
            out.append(f"- confirmed on {best.confirmed_on} (lease {best.lease_id})")
        static = shown.best_static
        if static is not None:
            out.append(f"- the best static configuration: {static.label()} → {_fmt(static.speedup)}×")
        command, note = shown.printed_command(), shown.printed_command_note()
        if command is None:
            out.append(f"- no command to print: {note}")
        else:
            if shown.deployment is not None and shown.deployment.proven_by:
                out.append(f"- the command below was {note}")
            elif note:
                out.append(f"- {note}")
            if shown.deployment is not None:
                out.append(f"- {shown.deployment.load_line}")
            out += ["", "```", command, "```"]
    return "\n".join(out) + "\n"


def refresh_study_note(ctx: ServiceContext, name: str) -> bool:
    """Rewrite the study's note if it changed; False for a study spectune does not manage."""
    try:
        shown = StudyService(ctx).show(name)
    except StudyNotFoundError:
        return False
    body = render_note(shown, baseline_lines(ctx, _baseline_key(ctx, name)))
    study = optuna.load_study(study_name=name, storage=ctx.storage)
    if get_note(study) != body:
        save_note(study, body)
    return True


def _baseline_key(ctx: ServiceContext, name: str) -> str:
    with ctx.sessions() as s:
        row = s.get(StudyRow, name)
        if row is None:
            raise StudyNotFoundError(name)
        return row.baseline_key
