"""Prompt sets: built-in sets shipped with spectune, or a file in the worker's prompt folder.

A workload names its prompts as ``builtin:<set>`` (``workers/prompts/<set>.jsonl`` inside the
installed package) or as a plain file name that the worker looks up in its own configured prompt
folder.  The API never chooses a path on the worker, so anything that is not a plain file name
is refused.

File format: JSON Lines with objects ``{"prompt": "..."}``, or plain text with one prompt per
line.  Blank lines are skipped.  Prompts are returned in file order, which is the order the load
generator sends them in (the same for the baseline and every trial).
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

from workers.loadgen.errors import LoadgenError

_BUILTIN_PREFIX = "builtin:"
_BUILTIN_NAME_RE = re.compile(r"^[a-z0-9_-]{1,32}\Z")
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}\Z")
# A prompt file larger than this is almost certainly a mistake (a data set, not a prompt list).
MAX_PROMPT_FILE_BYTES = 64 * 1024 * 1024


def load_prompts(spec: str, prompt_dir: Path | None) -> list[str]:
    """Load the prompts named by a workload's ``prompts`` field.

    Raises:
        ValueError: the name is malformed, escapes ``prompt_dir``, or no folder is configured.
        FileNotFoundError: the built-in set or the file does not exist.
        LoadgenError: the file holds no prompts or a malformed line.
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


def _parse(text: str, *, source: str) -> list[str]:
    prompts: list[str] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise LoadgenError(f"{source} line {lineno}: not valid JSON ({e.msg})") from e
            prompt = obj.get("prompt") if isinstance(obj, dict) else None
            if not isinstance(prompt, str) or not prompt:
                raise LoadgenError(f'{source} line {lineno}: expected {{"prompt": "<non-empty text>"}}')
            prompts.append(prompt)
        else:
            prompts.append(raw)
    if not prompts:
        raise LoadgenError(f"{source} holds no prompts")
    return prompts
