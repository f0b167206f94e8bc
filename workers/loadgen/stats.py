"""Fold the requests of a level's timed passes into one ``LevelMetrics``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import ValidationError

from spectune_protocol import LevelMetrics, RunKey, Slo
from workers.loadgen.errors import LoadgenError
from workers.loadgen.request import RequestResult


@dataclass(frozen=True, slots=True)
class PassResult:
    """One timed pass: ``num_prompts`` requests and the wall time from first send to last token."""

    wall_s: float
    requests: Sequence[RequestResult]

    @property
    def output_tok_s(self) -> float:
        tokens = sum(r.completion_tokens for r in self.requests)
        return tokens / self.wall_s if self.wall_s > 0 else 0.0


_PERCENTILE_KEYS: tuple[tuple[int, RunKey, RunKey], ...] = (
    (50, "ttft_ms_p50", "itl_ms_p50"),
    (90, "ttft_ms_p90", "itl_ms_p90"),
    (99, "ttft_ms_p99", "itl_ms_p99"),
)


def meets(r: RequestResult, slo: Slo) -> bool:
    """Does one request meet the SLO: its TTFT, and its time per output token after the first?"""
    if slo.ttft_ms is not None and r.ttft_s * 1e3 > slo.ttft_ms:
        return False
    return slo.itl_ms is None or r.decode_tok_s is None or 1e3 / r.decode_tok_s <= slo.itl_ms


def pass_figures(p: PassResult, slo: Slo | None) -> dict[RunKey, float]:
    """One pass's per-user rate, TTFT / ITL percentiles and (with an SLO) goodput: the per-pass
    values behind the intervals of objectives other than output tok/s (optimizer/objective.py)."""
    out: dict[RunKey, float] = {}
    decode = [r.decode_tok_s for r in p.requests if r.decode_tok_s is not None]
    if decode:
        out["per_user_tok_s"] = float(np.mean(decode))
    ttft = np.fromiter((r.ttft_s * 1e3 for r in p.requests), dtype=np.float64, count=len(p.requests))
    gaps = [np.asarray(r.itl_s, dtype=np.float64) for r in p.requests]
    itl = np.concatenate(gaps) * 1e3 if gaps else np.zeros(0)
    for q, ttft_key, itl_key in _PERCENTILE_KEYS:
        t, i = _percentile(ttft, q), _percentile(itl, q)
        if t is not None:
            out[ttft_key] = t
        if i is not None:
            out[itl_key] = i
    if slo is not None and p.wall_s > 0:
        good = [r for r in p.requests if meets(r, slo)]
        out["goodput_req_s"] = len(good) / p.wall_s
        out["goodput_tok_s"] = sum(r.completion_tokens for r in good) / p.wall_s
    return out


def summarize_level(concurrency: int, passes: Sequence[PassResult], slo: Slo | None = None) -> LevelMetrics:
    """Aggregate timed passes (warm-up excluded) into the level's metrics.

    - ``output_tok_s``: mean over passes of Σ completion_tokens / pass wall time; the per-pass
      values are kept in ``output_tok_s_runs`` for the spread.
    - TTFT and ITL percentiles: over every request / token of every pass.
    - ``per_user_tok_s``: mean over requests of each request's decode rate.
    - ``accept_length``: Σ completion_tokens / Σ spec_verify_ct over the requests that reported
      verify cycles; None when none did (a baseline server).
    - ``runs``: each pass's own figures (``pass_figures``); with ``slo``, goodput too.
    """
    if not passes:
        raise ValueError("summarize_level needs at least one pass")
    runs = [p.output_tok_s for p in passes]
    requests = [r for p in passes for r in p.requests]
    ttft_ms = np.fromiter((r.ttft_s * 1e3 for r in requests), dtype=np.float64, count=len(requests))
    itl_ms = np.concatenate([np.asarray(r.itl_s, dtype=np.float64) for r in requests]) * 1e3
    decode = [r.decode_tok_s for r in requests if r.decode_tok_s is not None]
    tokens = sum(r.completion_tokens for r in requests)
    spec = [r for r in requests if r.spec_verify_ct]
    verify_ct = sum(r.spec_verify_ct or 0 for r in spec)
    spec_tokens = sum(r.completion_tokens for r in spec)
    per_pass = [pass_figures(p, slo) for p in passes]
    figures: dict[RunKey, list[float]] = {}
    for f in per_pass:
        for key, value in f.items():
            figures.setdefault(key, []).append(value)
    try:
        metrics = _level_metrics(
            concurrency, runs, requests, ttft_ms, itl_ms, decode, tokens, spec, verify_ct, spec_tokens
        )
        return metrics.model_copy(
            update={
                "runs": figures,
                "goodput_req_s": _mean(figures.get("goodput_req_s")),
                "goodput_tok_s": _mean(figures.get("goodput_tok_s")),
            }
        )
    except ValidationError as e:
        # The API refuses such a report (e.g. no output at all: 0 tok/s); say so as a benchmark error.
        raise LoadgenError(f"concurrency {concurrency}: the measurement is out of range: {e.errors()[0]['msg']}") from e


def _level_metrics(
    concurrency: int,
    runs: list[float],
    requests: list[RequestResult],
    ttft_ms: np.ndarray,
    itl_ms: np.ndarray,
    decode: list[float],
    tokens: int,
    spec: list[RequestResult],
    verify_ct: int,
    spec_tokens: int,
) -> LevelMetrics:
    return LevelMetrics(
        concurrency=concurrency,
        output_tok_s=float(np.mean(runs)),
        output_tok_s_runs=runs,
        per_user_tok_s=float(np.mean(decode)) if decode else None,
        ttft_ms_p50=_percentile(ttft_ms, 50),
        ttft_ms_p90=_percentile(ttft_ms, 90),
        ttft_ms_p99=_percentile(ttft_ms, 99),
        itl_ms_p50=_percentile(itl_ms, 50),
        itl_ms_p90=_percentile(itl_ms, 90),
        itl_ms_p99=_percentile(itl_ms, 99),
        accept_length=spec_tokens / verify_ct if verify_ct else None,
        completion_tokens=tokens,
        spec_verify_ct=verify_ct if spec else None,
        num_requests=len(requests),
    )


def _mean(values: list[float] | None) -> float | None:
    return float(np.mean(values)) if values else None


def _percentile(values: np.ndarray, q: float) -> float | None:
    # An output length of 1 has no inter-token gaps: report None rather than a made-up 0.
    return float(np.percentile(values, q)) if values.size else None
