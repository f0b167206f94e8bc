"""The verify probe: the target's forward timed over a range of token counts on the baseline server.

A speculative cycle's verify is one target forward over b x n tokens (b running requests, n draft
tokens each).  The baseline server (no speculation) is already up when its benchmark ends, so
its forward over such token counts costs no restart to measure: warm a cached prefix, then send
batches of `concurrency` requests that each extend that prefix by k new tokens with
`max_new_tokens` 1.  Each batch is then one extend forward over `concurrency` x k tokens, the
verify's shape (tile steps, knees, expert saturation) on this very host.

How it is measured, and why:

* one `/generate` call per batch, its `input_ids` a list of prompts: SGLang hands a batch of
  pre-tokenized prompts to the scheduler at once (`TokenizerManager._send_batch_request`), so
  they are admitted in one prefill batch instead of trickling in over several;
* every prompt is the warmed prefix plus tokens no earlier request sent, so only the k new
  tokens are computed (the engine's `cached_tokens` says whether the prefix was found:
  `cached_share`);
* the token counts of one repeat are sent in turn, each repeat in the same order, so a slow drift
  hits every count alike; a point is the median of its repeats (`seconds_runs` keeps them all);
* bounded: at most `max_batch_tokens` tokens per batch (larger ones would be split into chunks
  by the engine and no longer be one forward), a wall-time budget, the lease's cancel event, and
  loopback only (the worker's own server; never a remote address).

The time of a batch is the wall time of its call, so it carries a constant overhead (HTTP, the
scheduler's own step) on top of the forward: `optimizer.verify_probe` removes it against the
baseline's decode step.
"""

from __future__ import annotations

import ipaddress
import statistics
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from optimizer.verify_probe import ProbePlan
from spectune_protocol import VerifyProbe, VerifyProbePoint
from workers.loadgen.errors import LoadgenCancelled, LoadgenError

# Token ids the probe sends: plain vocabulary of any tokenizer (no special tokens below 1000),
# and below 32000, the smallest vocabulary of the targets SGLang serves.
_FIRST_ID = 1000
_ID_RANGE = 30000


class ProbeRefused(LoadgenError):
    """The probe will not send to this address (only the worker's own server on loopback)."""


def is_loopback(base_url: str) -> bool:
    host = urlsplit(base_url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Ids:
    """Token ids no earlier prompt of this probe used at that position (so nothing past the prefix
    is ever cached); the prefix is a fixed sequence of its own."""

    def __init__(self, prefix_tokens: int) -> None:
        self.prefix = [_FIRST_ID + (i * 7919) % _ID_RANGE for i in range(prefix_tokens)]
        self._next = 0

    def fresh(self, k: int) -> list[int]:
        n = self._next
        self._next += 1
        # The first new token alone makes the prompt new: 131 is prime to the range, so it repeats
        # only after _ID_RANGE prompts (a probe sends a few hundred).
        return [_FIRST_ID + (n * 131 + j * 17) % _ID_RANGE for j in range(k)]


def _generate(client: httpx.Client, url: str, prompts: list[list[int]], timeout_s: float) -> list[dict[str, Any]]:
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    try:
        r = client.post(url, json=body, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise LoadgenError(f"verify probe: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise LoadgenError(f"verify probe: HTTP {r.status_code}: {r.text[:300]}")
    out = r.json()
    items = out if isinstance(out, list) else [out]
    if len(items) != len(prompts) or not all(isinstance(i, dict) and "error" not in i for i in items):
        raise LoadgenError(f"verify probe: the engine answered {len(items)} of {len(prompts)} prompts")
    return items


def run_verify_probe(
    base_url: str,
    plan: ProbePlan,
    *,
    cancel: threading.Event | None = None,
    client: httpx.Client | None = None,
) -> VerifyProbe:
    """Time the extends of `plan` on the server at `base_url` (loopback only).

    Never raises for what the engine answers: a failure or the budget ends the probe early and
    its `note` says why (the points measured before stand).  Raises ProbeRefused for a
    non-loopback address and LoadgenCancelled when `cancel` is set.
    """
    if not is_loopback(base_url):
        raise ProbeRefused(f"verify probe: {base_url} is not a loopback address; the probe times this host's server")
    started = time.monotonic()
    ids = _Ids(plan.prefix_tokens)
    url = base_url.rstrip("/") + "/generate"
    batches = plan.batches()
    runs: dict[tuple[int, int], list[float]] = {bk: [] for bk in batches}
    cached: list[bool] = []
    skipped = [(b, k) for b in plan.levels for k in set(plan.tokens) if b * k > plan.max_batch_tokens]
    note: str | None = None
    own = client is None
    http = client if client is not None else httpx.Client(trust_env=False)
    try:
        # Warm the prefix (twice: the second finds it cached where the engine caches at all) and
        # each level's batch path, unmeasured.
        _generate(http, url, [ids.prefix], plan.request_timeout_s)
        _generate(http, url, [ids.prefix + ids.fresh(1)], plan.request_timeout_s)
        for b in sorted({b for b, _ in batches}):
            _generate(http, url, [ids.prefix + ids.fresh(1) for _ in range(b)], plan.request_timeout_s)
        for _ in range(plan.repeats):
            for b, k in batches:
                if cancel is not None and cancel.is_set():
                    raise LoadgenCancelled("verify probe cancelled")
                if time.monotonic() - started > plan.budget_s:
                    raise TimeoutError
                prompts = [ids.prefix + ids.fresh(k) for _ in range(b)]
                t0 = time.perf_counter()
                items = _generate(http, url, prompts, plan.request_timeout_s)
                runs[(b, k)].append(time.perf_counter() - t0)
                for item in items:
                    got = (item.get("meta_info") or {}).get("cached_tokens")
                    if isinstance(got, int):
                        cached.append(got >= plan.prefix_tokens)
    except TimeoutError:
        note = f"stopped at its budget of {plan.budget_s:g} s"
    except LoadgenCancelled:
        raise
    except (LoadgenError, ValueError) as e:  # ValueError: a body that is not JSON
        note = f"stopped: {e}"[:500]
    finally:
        if own:
            http.close()
    if skipped and note is None:
        worst = max(b * k for b, k in skipped)
        note = f"{len(skipped)} batch(es) above {plan.max_batch_tokens} tokens skipped (up to {worst})"
    points = [
        VerifyProbePoint(concurrency=b, tokens=k, seconds=statistics.median(r), seconds_runs=r)
        for (b, k), r in runs.items()
        if r
    ]
    return VerifyProbe(
        points=points,
        prefix_tokens=plan.prefix_tokens,
        cached_share=None if not cached else sum(cached) / len(cached),
        spent_s=time.monotonic() - started,
        note=note,
    )
