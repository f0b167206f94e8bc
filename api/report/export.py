"""`spectune study export`: every trial at every level as flat rows (CSV) or as documents (JSON)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from typing import Any

from api.documents import Confirmation, StudyDocument, TrialRow
from optimizer.space import SpecConfig
from spectune_protocol.printable import printable

LEVEL_FIELDS = (
    "output_tok_s",
    "per_user_tok_s",
    "accept_length",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "itl_ms_p50",
    "itl_ms_p90",
    "itl_ms_p99",
)
COLUMNS = (
    "study",
    "trial",
    "state",
    "source",
    "num_steps",
    "topk",
    "num_draft_tokens",
    "cuda_graph_max_bs",
    "objective_speedup",
    "feasible",
    "concurrency",
    "baseline_tok_s",
    "speedup",
    *LEVEL_FIELDS,
    "startup_s",
    "worker_id",
    "failure_kind",
    "failure_message",
    "pruned_after_concurrency",
    "duplicate_of",
)


def rows(study: str, trials: Sequence[TrialRow]) -> list[dict[str, Any]]:
    """One row per trial and measured level (a trial without measurements: one row, no level)."""
    out = []
    for t in sorted(trials, key=lambda t: t.number):
        c = t.config
        base = {b.concurrency: b.output_tok_s for b in t.baseline_levels or []}
        by_level = t.speedup_by_level or t.partial_speedup_by_level or {}
        head = {
            "study": study,
            "trial": t.number,
            "state": t.state,
            "source": t.source,
            **_config_columns(c),
            "objective_speedup": t.speedup,
            "feasible": t.feasible,
            "startup_s": t.startup_s,
            "worker_id": t.worker_id,
            "failure_kind": t.failure_kind,
            "failure_message": t.failure_message,
            "pruned_after_concurrency": None if t.pruned is None else t.pruned.after_concurrency,
            "duplicate_of": t.duplicate_of,
        }
        if not t.levels:
            out.append(head)
            continue
        for lv in t.levels:
            row = head | {
                "concurrency": lv.concurrency,
                "baseline_tok_s": base.get(lv.concurrency),
                "speedup": by_level.get(str(lv.concurrency)),
            }
            row |= {k: getattr(lv, k) for k in LEVEL_FIELDS}
            out.append(row)
    return out


# A spreadsheet reads a cell that starts with one of these as a formula (`=HYPERLINK(...)` in a
# failure message a worker sent would become a live link, or worse).
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _config_columns(config: SpecConfig | None) -> dict[str, Any]:
    """The configuration's columns of a row (empty for a baseline)."""
    fields = ("num_steps", "topk", "num_draft_tokens", "cuda_graph_max_bs")
    return {f: None if config is None else getattr(config, f) for f in fields}


def cell(value: Any) -> Any:
    """A CSV cell: text with its control characters written as escapes (`printable`: the CSV is
    printed to a terminal by `study export`, and a worker's message may hold an OSC title or
    `ESC[2J`), and text that a spreadsheet would run as a formula with a leading `'`; numbers
    (negative ones too) stay numbers."""
    if value is None:
        return ""
    if not isinstance(value, str):
        return value
    value = printable(value)
    return "'" + value if value.startswith(_FORMULA_STARTS) else value


def confirmation_rows(study: str, confirmations: Sequence[Confirmation] | None) -> list[dict[str, Any]]:
    """One row per confirmation and level, `source` "confirmation": the launches the answer comes from."""
    out = []
    for c in confirmations or []:
        cfg = c.config
        base = {b.concurrency: b.output_tok_s for b in c.baseline_levels or []}
        by_level = c.speedup_by_level or {}
        head = {
            "study": study,
            "trial": c.trial_number,
            "state": f"confirmation {c.state}",
            # The adaptive answer's launch has no trial of its own: it runs several trials' chains.
            "source": "adaptive confirmation" if c.adaptive else "confirmation",
            **_config_columns(cfg),
            "objective_speedup": c.speedup,
            "worker_id": c.worker_id,
        }
        if not c.levels:
            out.append(head)
        for lv in c.levels or []:
            out.append(
                head
                | {
                    "concurrency": lv.concurrency,
                    "baseline_tok_s": base.get(lv.concurrency),
                    "speedup": by_level.get(str(lv.concurrency)),
                }
                | {k: getattr(lv, k) for k in LEVEL_FIELDS}
            )
    return out


def to_csv(study: str, trials: Sequence[TrialRow], confirmations: Sequence[Confirmation] | None = None) -> str:
    """Every trial at every level, then every confirmation at every level (the answer's launches)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in [*rows(study, trials), *confirmation_rows(study, confirmations)]:
        w.writerow({k: cell(r.get(k)) for k in COLUMNS})
    return buf.getvalue()


def to_json(shown: StudyDocument, trials: Sequence[TrialRow]) -> str:
    """The study document and every trial as the API gives them (nothing dropped)."""
    doc = {"study": shown.model_dump(mode="json"), "trials": [t.model_dump(mode="json") for t in trials]}
    return json.dumps(doc, indent=2)
