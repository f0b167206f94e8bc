"""One streamed request to SGLang's native ``POST /generate``, timed chunk by chunk.

Timing model (docs/sglang.md §7): every chunk's ``meta_info.completion_tokens`` is the
running total, so a chunk carries ``k = total - previous total`` new tokens.  Under speculative
decoding one chunk is one verify cycle and usually carries several tokens.

- TTFT is the time from sending the request to the first chunk that carries a token.
- Inter-token latency: the interval between two token-carrying chunks is spread evenly over the
  ``k`` tokens of the later chunk, giving ``k`` samples of ``interval / k``.  So the ITL
  percentiles describe the time per *token* a user sees, comparable between a baseline (one
  token per chunk) and a trial (a burst per cycle).  (SGLang's bench_serving instead records one
  sample per chunk; that makes speculative runs look slower per token at the percentiles.)
- Per-user decode tok/s is (tokens after the first chunk) / (last token time - first token time).

Chunks that carry no new token (e.g. a final chunk that only adds ``finish_reason``) are parsed
for their metadata but do not move the clock used for ITL.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import httpx

from workers.loadgen.errors import EngineRejected, LoadgenError
from workers.loadgen.http1 import LoadgenClient
from workers.loadgen.sse import DONE, SSEDecodeError, SSEDecoder

# How much of an HTTP error body goes into the error message.
_ERROR_BODY_BYTES = 2000


@dataclass(slots=True)
class RequestResult:
    """What one request measured.  Times are in seconds."""

    ttft_s: float
    e2e_s: float
    completion_tokens: int
    spec_verify_ct: int | None
    decode_tok_s: float | None
    itl_s: list[float] = field(default_factory=list)


def generate_payload(prompt: str, output_len: int) -> dict[str, Any]:
    """The request body: greedy, EOS ignored, so every request is exactly ``output_len`` tokens."""
    return {
        "text": prompt,
        "sampling_params": {"temperature": 0, "ignore_eos": True, "max_new_tokens": output_len},
        "stream": True,
    }


class _StreamState:
    """Folds the events of one stream into the measurements; raises LoadgenError on bad events."""

    __slots__ = (
        "label",
        "started",
        "prev_tokens",
        "first_t",
        "first_tokens",
        "last_t",
        "verify_ct",
        "finish_reason",
        "done",
        "itl",
    )

    def __init__(self, label: str, started: float) -> None:
        self.label = label
        self.started = started
        self.prev_tokens = 0
        self.first_t = 0.0
        self.first_tokens = 0
        self.last_t = 0.0
        self.verify_ct: int | None = None
        self.finish_reason: object = None
        self.done = False
        self.itl: list[float] = []

    def on_event(self, data: bytes, now: float) -> None:
        if data == DONE:
            self.done = True
            return
        if self.done:
            raise LoadgenError(f"{self.label}: the server sent an event after [DONE]")
        scanned = _scan_progress(data)
        if scanned is not None:  # the common case: a progress event, read without JSON
            self._advance(scanned[0], now)
            if scanned[1] is not None:
                self.verify_ct = scanned[1]
            return
        meta = _meta_info_fast(data)
        if meta is None:
            meta = self._meta_info_full(data)
        tokens = meta.get("completion_tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            raise LoadgenError(
                f"{self.label}: event without meta_info.completion_tokens; is this SGLang's native /generate? "
                f"event: {data[:200]!r}"
            )
        self._advance(tokens, now)
        verify = meta.get("spec_verify_ct")
        if isinstance(verify, int) and not isinstance(verify, bool):
            self.verify_ct = verify
        reason = meta.get("finish_reason")
        if reason is not None:
            self.finish_reason = reason

    def _advance(self, tokens: int, now: float) -> None:
        new = tokens - self.prev_tokens
        if new < 0:
            raise LoadgenError(
                f"{self.label}: completion_tokens went backwards ({self.prev_tokens} -> {tokens}); "
                "the stream is not SGLang's cumulative format"
            )
        if new:
            if self.prev_tokens == 0:
                self.first_t = now
                self.first_tokens = tokens
            else:
                gap = (now - self.last_t) / new
                self.itl.extend([gap] * new)
            self.last_t = now
            self.prev_tokens = tokens

    def _meta_info_full(self, data: bytes) -> dict[str, Any]:
        try:
            obj = json.loads(data)
        except ValueError as e:
            raise LoadgenError(f"{self.label}: malformed event (not JSON): {data[:200]!r}") from e
        if not isinstance(obj, dict):
            raise LoadgenError(f"{self.label}: malformed event (not a JSON object): {data[:200]!r}")
        error = obj.get("error")
        if error is not None:
            raise LoadgenError(f"{self.label}: the server sent an error event: {_error_text(error)}")
        meta = obj.get("meta_info")
        if not isinstance(meta, dict):
            raise LoadgenError(
                f"{self.label}: event without meta_info; is this SGLang's native /generate? event: {data[:200]!r}"
            )
        return meta

    def result(self, output_len: int, ended: float) -> RequestResult:
        if not self.done and self.finish_reason is None:
            raise LoadgenError(
                f"{self.label}: the stream ended after {self.prev_tokens} of {output_len} tokens "
                "without a finish_reason or [DONE] (server closed the connection?)"
            )
        if self.prev_tokens != output_len:
            raise LoadgenError(
                f"{self.label}: produced {self.prev_tokens} tokens, expected exactly {output_len} "
                f"(finish_reason={self.finish_reason!r}); the server must honour ignore_eos and "
                "max_new_tokens - check that prompt + output fit the context length"
            )
        decode_tokens = self.prev_tokens - self.first_tokens
        decode_s = self.last_t - self.first_t
        return RequestResult(
            ttft_s=self.first_t - self.started,
            e2e_s=ended - self.started,
            completion_tokens=self.prev_tokens,
            # 0 verify cycles is what a non-speculative server may report: no accept length.
            spec_verify_ct=self.verify_ct or None,
            decode_tok_s=decode_tokens / decode_s if decode_tokens > 0 and decode_s > 0 else None,
            itl_s=self.itl,
        )


_META_KEY = b'"meta_info":'


def _meta_info_fast(data: bytes) -> dict[str, Any] | None:
    """Parse only the ``meta_info`` object of an event, or return None to parse it all.

    SGLang puts ``meta_info`` last, after the cumulative ``text`` that grows with every token;
    skipping the text halves the JSON work per event.  The key cannot match inside a string (the
    quotes would be escaped there).  Anything unexpected - an ``"error"`` anywhere, other keys
    after ``meta_info``, invalid JSON - falls back to the full parse, which handles it.
    """
    i = data.rfind(_META_KEY)
    if i < 0 or b'"error"' in data or not data.endswith(b"}"):
        return None
    try:
        meta = json.loads(data[i + len(_META_KEY) : -1])
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


_TOKENS_KEY = b'"completion_tokens":'
_VERIFY_KEY = b'"spec_verify_ct":'
_FINISH_KEY = b'"finish_reason":'


def _scan_progress(data: bytes) -> tuple[int, int | None] | None:
    """(completion_tokens, spec_verify_ct or None) of a progress event, found by a byte scan.

    A JSON decode is half the generator's CPU per event; most events are progress events whose
    only news is the running token count.  The scan answers only where a JSON parse could not
    answer differently, and returns None (use the JSON path) otherwise:

    - the event ends with ``}}`` and has no ``{`` after the one opening ``meta_info``: so
      ``meta_info`` is the last key and a flat object, and every key found after it is one of its
      own keys (a key cannot match inside a string, where its quotes would be escaped);
    - there is no ``"error"`` key;
    - ``finish_reason`` is absent or ``null`` (SGLang's final event carries an object: JSON path);
    - ``completion_tokens`` (and ``spec_verify_ct`` if present) are plain non-negative integers;
      with a key given twice the last one counts, as in ``json.loads``.
    """
    i = data.rfind(_META_KEY)
    if i < 0 or not data.endswith(b"}}"):
        return None
    start = i + len(_META_KEY)
    brace = data.find(b"{", start)
    if brace < 0 or data.find(b"{", brace + 1) >= 0 or data[start:brace].strip() or b'"error"' in data:
        return None
    tokens = _raw_value(data, _TOKENS_KEY, brace)
    if tokens is None or not _is_json_uint(tokens):
        return None
    reason = _raw_value(data, _FINISH_KEY, brace)
    if reason is not None and reason != b"null":
        return None
    verify = _raw_value(data, _VERIFY_KEY, brace)
    if verify is not None and not _is_json_uint(verify):
        return None
    return int(tokens), None if verify is None else int(verify)


def _raw_value(data: bytes, key: bytes, start: int) -> bytes | None:
    """The raw scalar after the last ``key`` in the flat object ending ``data`` (None: no key)."""
    k = data.rfind(key, start)
    if k < 0:
        return None
    k += len(key)
    end = data.find(b",", k)
    if end < 0:
        end = len(data) - 2  # the object's closing brace (data ends with "}}")
    return data[k:end].strip()


def _is_json_uint(value: bytes) -> bool:
    # JSON integers have no leading zeros, signs, underscores or exponents.
    return value.isdigit() and (len(value) == 1 or value[0] != 0x30)


def _error_text(error: object) -> str:
    if isinstance(error, dict):
        message = error.get("message")
        if isinstance(message, str):
            return message[:1000]
    return str(error)[:1000]


async def stream_generate(
    client: httpx.AsyncClient,
    url: str,
    prompt: str,
    *,
    output_len: int,
    timeout_s: float,
    label: str,
) -> RequestResult:
    """Send one streamed ``/generate`` request and time its tokens.

    Raises LoadgenError (naming ``label``) on HTTP errors, error events, malformed streams,
    a wrong token count, or when the whole request takes longer than ``timeout_s``.
    """
    payload = generate_payload(prompt, output_len)
    started = perf_counter()
    state = _StreamState(label, started)
    try:
        async with asyncio.timeout(timeout_s):
            if isinstance(client, LoadgenClient):
                status, body = await client.sse.post(url, json.dumps(payload).encode(), state.on_event)
                if status != 200:
                    text = body.decode("utf-8", "replace").strip() or "(empty body)"
                    raise http_error(label, url, status, text)
            else:
                await _stream_with_httpx(client, url, payload, state, label)
    except TimeoutError as e:
        raise LoadgenError(
            f"{label}: no complete answer within {timeout_s:g} s after {state.prev_tokens} of {output_len} "
            "tokens; the server is stuck or too slow (raise the request time-out for long outputs)"
        ) from e
    except httpx.TimeoutException as e:
        raise LoadgenError(
            f"{label}: HTTP time-out ({type(e).__name__}) after {state.prev_tokens} of {output_len} tokens"
        ) from e
    except httpx.HTTPError as e:
        raise LoadgenError(
            f"{label}: request to {url} failed after {state.prev_tokens} of {output_len} tokens: "
            f"{type(e).__name__}: {e}"
        ) from e
    except SSEDecodeError as e:
        raise LoadgenError(f"{label}: {e}") from e
    return state.result(output_len, perf_counter())


async def _stream_with_httpx(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], state: _StreamState, label: str
) -> None:
    """The portable path, for any httpx client (about 10x more CPU per event than the fast path)."""
    decoder = SSEDecoder()
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            body = await _read_prefix(response)
            raise http_error(label, url, response.status_code, body)
        async for chunk in response.aiter_bytes():
            now = perf_counter()
            for data in decoder.feed(chunk):
                state.on_event(data, now)
        now = perf_counter()
        for data in decoder.close():
            state.on_event(data, now)


async def _read_prefix(response: httpx.Response) -> str:
    """The start of an error body, read without loading an unbounded body into memory."""
    buf = bytearray()
    async for chunk in response.aiter_bytes():
        buf += chunk
        if len(buf) >= _ERROR_BODY_BYTES:
            break
    return bytes(buf[:_ERROR_BODY_BYTES]).decode("utf-8", "replace").strip() or "(empty body)"


def http_error(label: str, url: str, status: int, body: str) -> LoadgenError:
    """A request's non-200 answer: 4xx is the engine refusing what the study asks (EngineRejected,
    a study fault the worker classifies), anything else a failed measurement.  408 and 429 say
    the engine was slow or busy, not that the request was wrong."""
    message = f"{label}: HTTP {status} from {url}: {body}"
    if 400 <= status < 500 and status not in (408, 429):
        return EngineRejected(message, status, body)
    return LoadgenError(message)
