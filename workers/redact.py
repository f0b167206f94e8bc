"""Host paths out of reports: the API shows reports to users, who need not learn a host's layout.

A worker's registry maps model names to local paths (`[models]`).  SGLang prints those paths in
its log (`model_path='/srv/models/...'`) and in `/server_info`, so before a report leaves the host
every registry path in it is replaced by its registry name.  Longest paths first, so a draft
model kept inside the target's folder is named, not half-replaced.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spectune_protocol import CompleteIn


def _pairs(models: Mapping[str, Path]) -> list[tuple[str, str]]:
    pairs: dict[str, str] = {}
    for name, path in models.items():
        for form in (str(path), str(path).rstrip("/")):
            if form and form not in (".", "/"):
                pairs[form] = name
        try:
            pairs.setdefault(str(path.resolve()), name)
        except OSError:
            pass
    return sorted(pairs.items(), key=lambda kv: len(kv[0]), reverse=True)


def redact_text(text: str, models: Mapping[str, Path]) -> str:
    for path, name in _pairs(models):
        text = text.replace(path, name)
    return text


def _redact_json(value: Any, models: Mapping[str, Path]) -> Any:
    if isinstance(value, str):
        return redact_text(value, models)
    if isinstance(value, dict):
        return {k: _redact_json(v, models) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_json(v, models) for v in value]
    return value


def redact_report(report: CompleteIn, models: Mapping[str, Path]) -> CompleteIn:
    """The report with every registry path replaced by its model name (log tails, messages, effective)."""
    if report.metrics is not None:
        m = report.metrics
        metrics = m.model_copy(
            update={"log_tail": redact_text(m.log_tail, models), "effective": _redact_json(m.effective, models)}
        )
        report = report.model_copy(update={"metrics": metrics})
    if report.failure is not None:
        f = report.failure
        failure = f.model_copy(
            update={"log_tail": redact_text(f.log_tail, models), "message": redact_text(f.message, models)}
        )
        report = report.model_copy(update={"failure": failure})
    return report
