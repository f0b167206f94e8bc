"""The field types and bounds every wire model uses: names, versions, plain text, numbers.

Names are checked by the same patterns the study spec uses (optimizer.spec imports them from
here), so what the API stores and what a worker accepts are one definition.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import ConfigDict, Field, StringConstraints

# `\Z`, not `$`: `$` also matches before a trailing newline, so "abc\n" would pass.
NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}\Z")
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}\Z")
# Placement labels: the keys and values a worker may carry (Inventory.labels).
LABEL_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,62}\Z")
LABEL_VALUE_RE = re.compile(r"[^\x00-\x1f\x7f]{0,128}\Z")

# Bounds on what a worker reports.  Every float is finite (NaN and Infinity, incl. JSON's 1e309,
# are refused), and within a range the API can divide and multiply without overflow: throughput
# above a billion tokens/s or latencies above a day are not measurements.  Throughput must be
# positive, since speedups are divided by a baseline's (a baseline of 0 would divide by zero).
MIN_TOK_S = 1e-3
MAX_TOK_S = 1e9
MAX_MS = 86_400_000.0
MAX_COUNT = 10**12
# `effective` (SGLang's /server_info) is nested a few levels; deeper JSON cannot be stored or
# rendered safely (serialisers recurse).
MAX_EFFECTIVE_DEPTH = 16


def anchored(pattern: str) -> str:
    """A `re` pattern ending in `\\Z` as pydantic-core wants it (`^...$`, where `$` is the very end)."""
    return "^" + pattern.removesuffix(r"\Z") + "$"


# Every text field is pattern-checked, both ways: what a worker reports is stored and shown, and
# what the API sends a worker is logged there and acted on.  No field can carry a newline (a
# forged log line), a control character or an unbounded amount of text.
# A version as SGLang and pip write them ("0.5.23", "v0.5.3rc0", "0.5.10.post1"):
# optimizer.sglang.parse_version reads every text this pattern admits.
VERSION_PATTERN = r"^v?\d{1,4}\.\d{1,4}\.\d{1,6}[A-Za-z0-9.+-]{0,32}$"
Version = Annotated[str, StringConstraints(pattern=VERSION_PATTERN)]
ModelName = Annotated[str, StringConstraints(pattern=anchored(MODEL_NAME_RE.pattern))]
LabelKey = Annotated[str, StringConstraints(pattern=anchored(LABEL_KEY_RE.pattern))]
LabelValue = Annotated[str, StringConstraints(pattern=anchored(LABEL_VALUE_RE.pattern))]
# Printable text without control characters (GPU names, host names).
Plain = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x1f\x7f]{0,255}$")]
Word = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,63}$")]
# A plain file name of a worker's prompt folder, as a workload names it (spectune_protocol.workload).
PromptFile = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")]
StudyName = Annotated[str, StringConstraints(pattern=anchored(NAME_RE.pattern))]
# The API's lease ids are uuid4s; any id a worker puts in a URL path is one plain segment.
LeaseId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
# Models a worker names in its inventory, and labels: enough for any real host, and an inventory
# stays a few tens of kB (150 ids x 1 MB inventories once made `GET /v1/workers` 145 MiB).
MAX_MODELS = 256
MAX_LABELS = 72  # 64 from the worker's config, plus the derived gpu_model and gpu_count
# What the API may ask of a worker's heartbeat: never a busy loop, never a silence of hours.
MIN_HEARTBEAT_S = 0.05
MAX_HEARTBEAT_S = 3600.0
# The speedups a confirmation's extra passes resolve against (Resolve.thresholds): no real
# speedup is near it; a larger stored one (a forged report, issue 35) is no threshold to resolve.
MAX_RESOLVE_THRESHOLD = 1000.0

TokS = Annotated[float, Field(ge=MIN_TOK_S, le=MAX_TOK_S)]
Millis = Annotated[float, Field(ge=0, le=MAX_MS)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
IN = ConfigDict(extra="forbid", allow_inf_nan=False)
# What the API sends: unknown fields are ignored (a newer API), but no number may be NaN or Infinity.
OUT = ConfigDict(allow_inf_nan=False)
