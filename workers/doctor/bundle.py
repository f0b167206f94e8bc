"""The support bundle `spectune doctor` writes: what a maintainer needs, nothing a host must keep.

Before anything is written, the worker's token (and any `engine.env` value whose name says it
is a secret) becomes `<redacted>`, every registry path becomes its registry name (as in lease
reports: workers/redact.py) and every other absolute path becomes `<path:HASH>`, the first 10 hex
digits of its sha256: two mentions of one path still match, the path itself is not in the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from workers.redact import redact_text

REDACTED = "<redacted>"
# A variable of engine.env whose value is kept out of the bundle (HF_TOKEN, WANDB_API_KEY, ...).
SECRET_NAME_RE = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|(^|_)KEY($|_)|AUTH", re.IGNORECASE)
# An absolute path: a "/" not preceded by a word character, ":" or "/" (so URLs keep their host).
_PATH_RE = re.compile(r"(?<![\w:/.~-])/(?:[\w.+@%~-]+/?)+")


def path_mark(path: str) -> str:
    return f"<path:{hashlib.sha256(path.encode()).hexdigest()[:10]}>"


class Redactor:
    """Applies the bundle's redactions to text and to JSON-like values."""

    def __init__(self, *, secrets: Iterable[str], models: Mapping[str, Path]) -> None:
        # Longest first, so a secret containing another is replaced whole.
        self._secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)
        self._models = dict(models)

    def text(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        text = redact_text(text, self._models)
        return _PATH_RE.sub(lambda m: path_mark(m.group(0).rstrip("/")), text)

    def value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self.text(str(k)): self.value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(v) for v in value]
        return value


def write_bundle(path: Path, doc: Mapping[str, Any], redactor: Redactor) -> None:
    """`doc`, redacted, as JSON at `path`, readable by its owner only (it describes the host)."""
    text = json.dumps(redactor.value(doc), indent=2, sort_keys=True, default=str) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
