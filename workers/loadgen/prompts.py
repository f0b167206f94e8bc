"""Prompt sets and datasets: built-in sets shipped with spectune, or a file in the worker's prompt folder.

A workload names its prompts as ``builtin:<set>`` (``workers/prompts/<set>.jsonl`` inside the
installed package) or as a plain file name that the worker looks up in its own configured prompt
folder.  The API never chooses a path on the worker, so anything that is not a plain file name
is refused.

File formats, told apart by their content:

* ShareGPT JSON: an array of ``{"conversations": [{"from": "human", "value": ...},
  {"from": "gpt", "value": ...}, ...]}`` (as ``sglang.bench_serving --dataset-name sharegpt``
  reads it): the first human turn is the prompt, the reply after it the recorded output;
* OpenAI chat JSON Lines: ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}],
  "max_tokens": N}``: the messages up to the last user turn are the prompt (one per line, as
  ``role: content``), and ``max_tokens``, or else an assistant reply after it, the recorded output;
* JSON Lines ``{"prompt": "...", "output_len": N}`` (``output_len`` optional);
* plain text, one prompt per line.

A record's recorded output length is what ``output_len_source: dataset`` sends: an explicit
number of tokens, or the recorded reply's length estimated at 4 characters a token (the worker
has no tokenizer; SGLang's bench_serving counts with the model's).  Blank lines are skipped.
Records are returned in file order, which is the order the load generator sends them in (the
same for the baseline and every trial).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from workers.loadgen.errors import LoadgenError

_BUILTIN_PREFIX = "builtin:"
_BUILTIN_NAME_RE = re.compile(r"^[a-z0-9_-]{1,32}\Z")
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}\Z")
# A prompt file larger than this is almost certainly a mistake (a data set, not a prompt list).
MAX_PROMPT_FILE_BYTES = 64 * 1024 * 1024


# Characters per token for lengths estimated from text (a common rule of thumb for English BPE).
CHARS_PER_TOKEN = 4
MAX_RECORDED_OUTPUT_LEN = 32768


@dataclass(frozen=True, slots=True)
class DatasetRecord:
    """One request of a prompt set: its prompt and, where the file records one, its output length."""

    prompt: str
    output_len: int | None = None


def estimate_tokens(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def load_prompts(spec: str, prompt_dir: Path | None) -> list[str]:
    """The prompts named by a workload's ``prompts`` field (see `load_dataset`)."""
    return [r.prompt for r in load_dataset(spec, prompt_dir)]


def load_dataset(spec: str, prompt_dir: Path | None) -> list[DatasetRecord]:
    """Load the records named by a workload's ``prompts`` field, in file order.

    Raises:
        ValueError: the name is malformed, escapes ``prompt_dir``, or no folder is configured.
        FileNotFoundError: the built-in set or the file does not exist.
        LoadgenError: the file holds no prompts or a malformed record.
    """
    if spec.startswith(_BUILTIN_PREFIX):
        name = spec[len(_BUILTIN_PREFIX) :]
        if not _BUILTIN_NAME_RE.match(name):
            raise ValueError(f"built-in prompt sets are named like 'builtin:chat', got {spec!r}")
        resource = resources.files("workers").joinpath("prompts", f"{name}.jsonl")
        if not resource.is_file():
            raise FileNotFoundError(
                f"no built-in prompt set {name!r}; available: {', '.join(builtin_sets()) or 'none'}"
            )
        return _parse(resource.read_text(encoding="utf-8"), source=spec)
    return _parse(_read_prompt_file(spec, prompt_dir), source=spec)


def is_prompt_file_name(name: str) -> bool:
    """A name a workload may give for a file of the prompt folder (plain, not hidden)."""
    return bool(_FILE_NAME_RE.match(name)) and not name.startswith(".")


def builtin_sets() -> list[str]:
    """Names of the prompt sets shipped with the package (``builtin:<name>``)."""
    folder = resources.files("workers").joinpath("prompts")
    if not folder.is_dir():
        return []
    return sorted(p.name.removesuffix(".jsonl") for p in folder.iterdir() if p.name.endswith(".jsonl"))


def _read_prompt_file(name: str, prompt_dir: Path | None) -> str:
    if prompt_dir is None:
        raise ValueError(
            f"workload prompts {name!r} names a file, but this worker has no prompt folder configured; "
            "set one in the worker config or use a built-in set such as 'builtin:chat'"
        )
    if not _FILE_NAME_RE.match(name) or name.startswith("."):
        raise ValueError(
            f"prompt file {name!r} must be a plain file name inside the prompt folder "
            "(letters, digits, . _ -; no path separators, not starting with '.')"
        )
    # Messages name the file, never the folder: they reach users in the study's `refused_by`.
    root = prompt_dir.resolve()
    path = (root / name).resolve()
    # A symlink inside the folder may not lead out of it either.
    if path.parent != root:
        raise ValueError(f"prompt file {name!r} resolves outside this worker's prompt folder")
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {name!r} not found in this worker's prompt folder")
    size = path.stat().st_size
    if size > MAX_PROMPT_FILE_BYTES:
        raise ValueError(f"prompt file {name!r} is {size} bytes; the limit is {MAX_PROMPT_FILE_BYTES}")
    return path.read_text(encoding="utf-8")


def _parse(text: str, *, source: str) -> list[DatasetRecord]:
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise LoadgenError(f"{source}: not valid JSON ({e.msg} at line {e.lineno})") from e
        records = [r for n, item in enumerate(items, start=1) if (r := _record(item, f"{source} entry {n}"))]
    else:
        records = list(_lines(text, source))
    if not records:
        raise LoadgenError(f"{source} holds no prompts")
    return records


def _lines(text: str, source: str) -> Iterable[DatasetRecord]:
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if not line.startswith("{"):
            yield DatasetRecord(raw)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise LoadgenError(f"{source} line {lineno}: not valid JSON ({e.msg})") from e
        record = _record(obj, f"{source} line {lineno}")
        if record is not None:
            yield record


def _record(obj: Any, where: str) -> DatasetRecord | None:
    """One record of any supported shape; None for a conversation with no prompt (skipped, as
    bench_serving skips ShareGPT entries with fewer than two turns)."""
    if not isinstance(obj, dict):
        raise LoadgenError(f"{where}: expected a JSON object")
    explicit = _explicit_len(obj, where)
    if "conversations" in obj:
        return _sharegpt(obj["conversations"], explicit, where)
    if "messages" in obj:
        return _openai_chat(obj["messages"], explicit, where)
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise LoadgenError(
            f'{where}: expected {{"prompt": "<non-empty text>"}}, a ShareGPT "conversations" list '
            'or an OpenAI chat "messages" list'
        )
    return DatasetRecord(prompt, explicit)


def _explicit_len(obj: Mapping[str, Any], where: str) -> int | None:
    for key in ("output_len", "max_tokens", "max_completion_tokens"):
        value = obj.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RECORDED_OUTPUT_LEN:
            raise LoadgenError(f"{where}: {key} must be an integer in 1..{MAX_RECORDED_OUTPUT_LEN}")
        return value
    return None


def _sharegpt(turns: Any, explicit: int | None, where: str) -> DatasetRecord | None:
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise LoadgenError(f'{where}: "conversations" must be a list of {{"from", "value"}} objects')
    for i, turn in enumerate(turns):
        value = turn.get("value")
        if turn.get("from") in ("human", "user") and isinstance(value, str) and value:
            reply = next((t.get("value") for t in turns[i + 1 :] if t.get("from") in ("gpt", "assistant")), None)
            if explicit is None and not (isinstance(reply, str) and reply):
                return None  # no recorded reply: bench_serving skips such entries too
            return DatasetRecord(value, explicit if explicit is not None else _capped(estimate_tokens(reply or "")))
    return None


def _openai_chat(messages: Any, explicit: int | None, where: str) -> DatasetRecord | None:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
    ):
        raise LoadgenError(f'{where}: "messages" must be a list of {{"role", "content"}} objects')
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is None:
        return None
    prompt = "\n".join(f"{m.get('role')}: {m['content']}" for m in messages[: last_user + 1])
    reply = next((m["content"] for m in messages[last_user + 1 :] if m.get("role") == "assistant"), None)
    recorded = explicit if explicit is not None else None if not reply else _capped(estimate_tokens(reply))
    return DatasetRecord(prompt, recorded)


def _capped(n: int) -> int:
    return min(max(1, n), MAX_RECORDED_OUTPUT_LEN)
