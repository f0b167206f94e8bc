"""The engine's HTTP 4xx answer to a benchmark request: what in the study's spec it points at.

SGLang answers 400 when a request asks what it will not serve: a prompt longer than the model's
context ("The input (N tokens) is longer than the model's context length (M tokens)", or
"Requested token count exceeds the model's maximum context length"), sampling parameters it
refuses.  Every host answers the same requests the same way, so such a failure is the study's, and
the worker reports it as `request_rejected` naming the spec field (spectune_protocol.SpecField);
it used to be a `benchmark_error` charged to the host, and one such spec quarantined host after
host (issue 35).
"""

from __future__ import annotations

import re

from spectune_protocol import SpecField
from workers.loadgen.errors import EngineRejected, LoadgenError

# A request's non-200 answer as the load generator words it (request.http_error); a shard's
# error crosses a process boundary as text, so the status is read back from the words too.
_HTTP_STATUS = re.compile(r"HTTP (\d{3}) from ")
# Neither says the request was wrong: the engine was slow (408) or busy (429).
_NOT_THE_REQUEST = (408, 429)
# What the engine's words point at, first match wins (lower case).
_FIELDS: tuple[tuple[tuple[str, ...], SpecField], ...] = (
    (("context length", "context_length", "context window", "longer than the model"), "workload.input_len"),
    (("max_new_tokens", "max_tokens", "max_completion_tokens"), "workload.output_len"),
    (("prompt", "input_ids", "text must be"), "workload.prompts"),
)


def rejected_field(error: LoadgenError) -> SpecField | None:
    """The spec field an engine's 4xx answer points at ("workload" where its words name none), or
    None when the error is no 4xx answer (a time-out, a 5xx, a broken stream)."""
    if isinstance(error, EngineRejected):
        status, text = error.status, error.body
    else:
        m = _HTTP_STATUS.search(str(error))
        if m is None:
            return None
        status, text = int(m.group(1)), str(error)[m.end() :]
    if not 400 <= status < 500 or status in _NOT_THE_REQUEST:
        return None
    low = text.lower()
    return next((field for words, field in _FIELDS if any(w in low for w in words)), "workload")
