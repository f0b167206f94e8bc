"""What the server really runs: `/server_info` read back and compared with what was asked (docs/sglang.md §5).

SGLang may resolve flags differently from what was asked (topk 1 forces draft tokens to steps+1;
a missing --max-running-requests becomes 48 with speculation), so a trial records the effective
values, and any difference from the request as a mismatch.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from optimizer.sglang import ServerSettings

logger = logging.getLogger("spectune.worker.launcher")

EFFECTIVE_FIELDS = (
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "attention_backend",
    "max_running_requests",
    "page_size",
    "cuda_graph_max_bs",
    "cuda_graph_max_bs_decode",
    "speculative_adaptive",  # SGLang switches it off silently where unsupported (docs/sglang.md §2)
)
# Per-DP-rank values that only internal_states holds.
_INTERNAL_FIELDS = ("effective_max_running_requests_per_dp",)
_TIMEOUT_S = 10.0


def fetch_server_info(client: httpx.Client, base_url: str) -> dict[str, Any]:
    """`/server_info`, or the deprecated `/get_server_info` of older servers; {} (logged) when neither answers."""
    for path in ("/server_info", "/get_server_info"):
        try:
            r = client.get(f"{base_url}{path}", timeout=_TIMEOUT_S)
        except httpx.HTTPError as e:
            logger.warning("GET %s failed: %s", path, e)
            continue
        if r.status_code == 200:
            try:
                body = r.json()
            except ValueError:
                logger.warning("GET %s answered something that is not JSON", path)
                continue
            if isinstance(body, dict):
                return body
        logger.info("GET %s answered %d", path, r.status_code)
    logger.warning("could not read the server's settings back: effective settings are unknown for this launch")
    return {}


def effective_settings(server_info: dict[str, Any]) -> dict[str, Any]:
    """The fields of EFFECTIVE_FIELDS the server reported (top level first, else its first DP rank)."""
    states = server_info.get("internal_states")
    first = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    out: dict[str, Any] = {}
    for key in EFFECTIVE_FIELDS:
        if key in server_info:
            out[key] = server_info[key]
        elif key in first:
            out[key] = first[key]
    for key in _INTERNAL_FIELDS:
        if key in first:
            out[key] = first[key]
    return out


def _same(asked: Any, got: Any) -> bool:
    if asked == got:
        return True
    # JSON may carry a number as text, or a backend name in another case.
    return asked is not None and got is not None and str(asked).lower() == str(got).lower()


def asked_settings(settings: ServerSettings) -> dict[str, Any]:
    """What the request asked for, as the server would report it (draft tokens as requested, not canonical)."""
    asked: dict[str, Any] = {
        "attention_backend": settings.attention_backend,
        "max_running_requests": settings.max_running_requests,
        "page_size": settings.page_size,
        "speculative_algorithm": settings.algorithm if settings.speculative is not None else None,
    }
    spec = settings.speculative
    if spec is not None:
        asked["speculative_num_steps"] = spec.num_steps
        asked["speculative_eagle_topk"] = spec.topk
        asked["speculative_num_draft_tokens"] = spec.num_draft_tokens
    if settings.adaptive is not None:
        asked["speculative_adaptive"] = True
    if settings.cuda_graph_max_bs is not None and not settings.cuda_graph_bs:
        asked["cuda_graph_max_bs"] = settings.cuda_graph_max_bs
    return asked


def find_mismatches(settings: ServerSettings, effective: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """field -> (asked, effective) wherever the server reported something else than was asked.

    Fields the server did not report are unknown, not mismatches.  The captured-batch limit is
    compared with whichever name this SGLang reports (`cuda_graph_max_bs_decode` from 0.5.16).
    """
    out: dict[str, tuple[Any, Any]] = {}
    for key, want in asked_settings(settings).items():
        got_key = key
        if key == "cuda_graph_max_bs" and "cuda_graph_max_bs_decode" in effective:
            got_key = "cuda_graph_max_bs_decode"
        if got_key not in effective:
            continue
        got = effective[got_key]
        if not _same(want, got):
            out[key] = (want, got)
    return out
