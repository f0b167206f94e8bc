"""Per-trial artifacts (benchmark report JSON, server-log tail) in the store the dashboard reads.

Optuna keeps an artifact's metadata as a system attr of its trial, and a finished trial is
immutable: the files must be uploaded *before* the trial is told (docs/optuna.md §8).  So
the lease service calls `store_trial_artifacts` on `complete`, just before it tells Optuna.

The store is a folder (`SPECTUNE_ARTIFACT_DIR`).  With several API processes on several hosts it
must be a shared volume: every process writes there and the dashboard of every process reads it.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from pathlib import Path
from typing import Any

from optuna.artifacts import FileSystemArtifactStore, upload_artifact
from optuna.artifacts.exceptions import ArtifactNotFound

from api.context import ServiceContext

log = logging.getLogger("spectune.api.artifacts")

BENCHMARK_FILE = "benchmark.json"
SERVER_LOG_FILE = "server-log-tail.txt"

# Workers replace their registry paths with model names before they report (workers/redact.py);
# this is the second line of defence for an older or foreign worker: SGLang's own ways of
# printing a path (`model_path='/srv/...'` in its ServerArgs line, `--model-path /srv/...`).
# Only values that read as filesystem paths (absolute, home or relative): a registry name such as
# `meta-llama/Llama-3.1-8B`, which a worker puts in their place, stays.
_PATH_ASSIGNMENT = re.compile(r"""(\b\w*path=)('[/~.][^'\n]*'|"[/~.][^"\n]*")""")
_PATH_FLAG = re.compile(r"(--[a-z-]*path[ =])([/~.]\S*)")
REDACTED = "<host path>"


# An absolute or home path anywhere in a message (not the `//` of a URL): `/srv/prompts/a.jsonl`.
_ANY_PATH = re.compile(r"(?<![\w.:/~-])~?(?:/[\w.+@-]+)+/?")


def paths_to_names(text: str) -> str:
    """Every absolute path in a message replaced by its last part (`/srv/prompts/a.jsonl` ->
    `a.jsonl`): a worker's refusal names the file or folder it missed, never where it looked."""

    def name(m: re.Match[str]) -> str:
        parts = [p for p in m.group().split("/") if p and p != "~"]
        return parts[-1] if parts else REDACTED

    return _ANY_PATH.sub(name, text)


def redact_host_paths(text: str) -> str:
    """The log text with path-valued settings replaced by a placeholder."""
    text = _PATH_ASSIGNMENT.sub(lambda m: f"{m.group(1)}'{REDACTED}'", text)
    return _PATH_FLAG.sub(lambda m: f"{m.group(1)}{REDACTED}", text)


def make_artifact_store(artifact_dir: str | Path) -> FileSystemArtifactStore:
    """The store under `artifact_dir`, created if missing (the dashboard serves from it too)."""
    path = Path(artifact_dir)
    path.mkdir(parents=True, exist_ok=True)
    return FileSystemArtifactStore(str(path))


def store_trial_artifacts(
    ctx: ServiceContext,
    study_name: str,
    trial_number: int,
    report: dict[str, Any] | str,
    log_text: str | None = None,
) -> list[str]:
    """Upload a trial's benchmark report (JSON) and, when given, its server-log tail.

    Call while the trial is still RUNNING (before `tell`); returns the artifact ids.  Uploading
    is best effort: a full disk must not lose the measurement itself, so failures are logged and
    the ids uploaded so far are returned.
    """
    store = make_artifact_store(ctx.settings.artifact_dir)
    # One trial by number, not the whole study: this runs on every completed trial.
    storage = ctx.storage
    try:
        trial_id = storage.get_trial_id_from_study_id_trial_number(
            storage.get_study_id_from_name(study_name), trial_number
        )
    except KeyError as e:
        raise KeyError(f"study {study_name!r} has no trial {trial_number}") from e
    trial = storage.get_trial(trial_id)
    body = report if isinstance(report, str) else json.dumps(report, indent=2, sort_keys=True, default=str)
    files = [(BENCHMARK_FILE, body, "application/json")]
    if log_text:
        files.append((SERVER_LOG_FILE, redact_host_paths(log_text), "text/plain"))
    ids: list[str] = []
    with tempfile.TemporaryDirectory(prefix="spectune-artifact-") as tmp:
        for filename, text, mimetype in files:
            # The dashboard shows the uploaded file's base name, so name the file for the reader.
            path = Path(tmp) / filename
            path.write_text(text, encoding="utf-8")
            try:
                ids.append(
                    upload_artifact(
                        artifact_store=store,
                        file_path=str(path),
                        study_or_trial=trial,
                        storage=ctx.storage,
                        mimetype=mimetype,
                        encoding="utf-8",
                    )
                )
            except (OSError, RuntimeError) as e:
                log.warning("trial %d of %s: could not store %s: %s", trial_number, study_name, filename, e)
    return ids


def read_artifact(store: FileSystemArtifactStore, artifact_id: str) -> bytes:
    """The bytes of one artifact; KeyError when the store has no such id."""
    try:
        with store.open_reader(artifact_id) as f:
            return f.read()
    except ArtifactNotFound as e:
        raise KeyError(artifact_id) from e
