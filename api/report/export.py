"""`spectune study export`: every trial at every level as flat rows (CSV) or as documents (JSON)."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

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


def rows(study: str, trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per trial and measured level (a trial without measurements: one row, no level)."""
    out = []
    for t in sorted(trials, key=lambda t: t["number"]):
        c = t.get("config") or {}
        base = {int(b["concurrency"]): b.get("output_tok_s") for b in t.get("baseline_levels") or []}
        by_level = t.get("speedup_by_level") or t.get("partial_speedup_by_level") or {}
        head = {
            "study": study,
            "trial": t["number"],
            "state": t["state"],
            "source": t.get("source"),
            "num_steps": c.get("num_steps"),
            "topk": c.get("topk"),
            "num_draft_tokens": c.get("num_draft_tokens"),
            "cuda_graph_max_bs": c.get("cuda_graph_max_bs"),
            "objective_speedup": t.get("speedup"),
            "feasible": t.get("feasible"),
            "startup_s": t.get("startup_s"),
            "worker_id": t.get("worker_id"),
            "failure_kind": t.get("failure_kind"),
            "failure_message": t.get("failure_message"),
            "pruned_after_concurrency": (t.get("pruned") or {}).get("after_concurrency"),
            "duplicate_of": t.get("duplicate_of"),
        }
        levels = t.get("levels") or []
        if not levels:
            out.append(head)
            continue
        for lv in levels:
            level = int(lv["concurrency"])
            row = head | {
                "concurrency": level,
                "baseline_tok_s": base.get(level),
                "speedup": by_level.get(str(level)),
            }
            row |= {k: lv.get(k) for k in LEVEL_FIELDS}
            out.append(row)
    return out


# A spreadsheet reads a cell that starts with one of these as a formula (`=HYPERLINK(...)` in a
# failure message a worker sent would become a live link, or worse).
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def cell(value: Any) -> Any:
    """A CSV cell: text that a spreadsheet would run as a formula gets a leading `'`; numbers
    (negative ones too) stay numbers."""
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(_FORMULA_STARTS):
        return "'" + value
    return value


def confirmation_rows(study: str, confirmations: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """One row per confirmation and level, `source` "confirmation": the launches the answer comes from."""
    out = []
    for c in confirmations or []:
        cfg = c.get("config") or {}
        base = {int(b["concurrency"]): b.get("output_tok_s") for b in c.get("baseline_levels") or []}
        by_level = c.get("speedup_by_level") or {}
        head = {
            "study": study,
            "trial": c["trial_number"],
            "state": f"confirmation {c['state']}",
            "source": "confirmation",
            "num_steps": cfg.get("num_steps"),
            "topk": cfg.get("topk"),
            "num_draft_tokens": cfg.get("num_draft_tokens"),
            "cuda_graph_max_bs": cfg.get("cuda_graph_max_bs"),
            "objective_speedup": c.get("speedup"),
            "worker_id": c.get("worker_id"),
        }
        levels = c.get("levels") or []
        if not levels:
            out.append(head)
        for lv in levels:
            level = int(lv["concurrency"])
            out.append(
                head
                | {"concurrency": level, "baseline_tok_s": base.get(level), "speedup": by_level.get(str(level))}
                | {k: lv.get(k) for k in LEVEL_FIELDS}
            )
    return out


def to_csv(study: str, trials: list[dict[str, Any]], confirmations: list[dict[str, Any]] | None = None) -> str:
    """Every trial at every level, then every confirmation at every level (the answer's launches)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in [*rows(study, trials), *confirmation_rows(study, confirmations)]:
        w.writerow({k: cell(r.get(k)) for k in COLUMNS})
    return buf.getvalue()


def to_json(shown: dict[str, Any], trials: list[dict[str, Any]]) -> str:
    """The study document and every trial as the API gives them (nothing dropped)."""
    return json.dumps({"study": shown, "trials": trials}, indent=2, default=str)
