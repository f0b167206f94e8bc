"""The worker's TOML configuration (`spectune worker --config worker.toml`), validated up front.

Every mistake an operator can make in the file is reported once, at start-up, as a `ConfigError`
that names the key (`engine.port`, `models.llama-8b`) and says how to fix it; the agent never
discovers a bad path an hour into a study.  Relative paths are read relative to the config file,
so a config and its token file can be moved together.  `workers/worker.example.toml` documents
every key.

The token itself is never a config value: it lives in `token_file` (mode 0600), is read by
`read_token()` and is never logged.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import stat
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from optimizer.sglang import parse_version
from optimizer.spec import MODEL_NAME_RE
from workers.errors import ConfigError

log = logging.getLogger("spectune.worker.config")

# The worker id is part of URL paths (/v1/workers/{id}/lease): keep it to URL-safe characters.
WORKER_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}\Z")
# Environment variable names the engine may receive (POSIX portable names).
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
# A module path for `python -m`: dotted identifiers only, so nothing else can be smuggled in.
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
# A long option of the server's command line, as argparse spells them.
FLAG_RE = re.compile(r"^--[a-z0-9][a-z0-9-]{0,62}\Z")

# Extra server flags this worker passes on from a lease when its config says nothing else.  The
# API checks a study's extra_args against its own allowlist (optimizer/spec.py), but the worker
# must not trust the API (SECURITY.md): these shape the server and name no file, no network
# address and no code.  `--trust-remote-code` is deliberately missing: it runs Python shipped
# with a model, so an operator opts in per host.
DEFAULT_ALLOWED_EXTRA_ARGS: tuple[str, ...] = (
    "--chunked-prefill-size",
    "--disable-overlap-schedule",
    "--disable-radix-cache",
    "--dp-size",
    "--dtype",
    "--enable-dp-attention",
    "--ep-size",
    "--kv-cache-dtype",
    "--max-prefill-tokens",
    "--moe-runner-backend",
    "--quantization",
    "--schedule-conservativeness",
)
# Flags the worker sets itself from its own config or typed lease values, or that name paths,
# addresses or code: no allowlist may let a lease set them (argparse keeps the last occurrence,
# so an extra `--model-path` would override the registry's path).
RESERVED_FLAGS = frozenset(
    {
        "--model-path",
        "--tokenizer-path",
        "--speculative-draft-model-path",
        "--host",
        "--port",
        "--download-dir",
        "--config",
        "--chat-template",
        "--json-model-override-args",
        "--preferred-sampling-params",
        "--enable-custom-logit-processor",
        "--custom-weight-loader",
        "--api-key",
        "--log-requests",
        # Set by the worker from a lease's typed adaptive steps, with a file it writes itself.
        "--speculative-adaptive",
        "--speculative-adaptive-config",
    }
)


class _Section(BaseModel):
    # Unknown keys are errors: a typo such as `startup = 600` would otherwise be silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSection(_Section):
    """How the SGLang (or simulated) server is started on this host."""

    # Interpreter that has SGLang installed; a bare name is looked up on PATH.
    python: Path = Field(default_factory=lambda: Path(sys.executable))
    module: str = "sglang.launch_server"
    host: str = "127.0.0.1"
    port: int = Field(default=30000, ge=1, le=65535)
    env: dict[str, str] = Field(default_factory=dict)
    # Override the version read from the interpreter (only when detection is impossible).
    sglang_version: str | None = None
    log_dir: Path = Path("logs")
    # Extra server flags a lease may ask for (study `model.extra_args`); any other is refused.
    allowed_extra_args: tuple[str, ...] = DEFAULT_ALLOWED_EXTRA_ARGS

    @field_validator("module")
    @classmethod
    def _module(cls, v: str) -> str:
        if not MODULE_RE.match(v):
            raise ValueError(f"{v!r} is not a Python module path; use e.g. 'sglang.launch_server'")
        return v

    @field_validator("allowed_extra_args")
    @classmethod
    def _allowed_extra_args(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for flag in v:
            if not FLAG_RE.match(flag):
                raise ValueError(f"{flag!r} is not a server flag; write long options such as '--dtype'")
            if flag in RESERVED_FLAGS:
                raise ValueError(
                    f"{flag} cannot be allowed: the worker sets it itself, or it names a file, an address or code"
                )
        return tuple(sorted(set(v)))

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not ENV_NAME_RE.match(name):
                raise ValueError(f"{name!r} is not an environment variable name (letters, digits, _)")
        if "CUDA_VISIBLE_DEVICES" in v:
            raise ValueError("do not set CUDA_VISIBLE_DEVICES here; list the GPU indices in the top-level `gpus` key")
        return v

    @field_validator("sglang_version")
    @classmethod
    def _version(cls, v: str | None) -> str | None:
        if v is not None:
            parse_version(v)  # raises ValueError with an example of the expected form
        return v


class TimeoutsSection(_Section):
    """Time limits, in seconds."""

    startup_s: float = Field(default=1200.0, gt=0, le=24 * 3600)
    stop_s: float = Field(default=60.0, gt=0, le=3600)
    gpu_release_s: float = Field(default=120.0, gt=0, le=3600)
    # One benchmark request to the engine (a long output at high concurrency can take minutes).
    request_s: float = Field(default=600.0, gt=0, le=24 * 3600)
    # Heartbeat interval; by default the one the API sends with each lease.  When set, the worker
    # uses the smaller of the two.
    heartbeat_s: float | None = Field(default=None, gt=0, le=3600)
    # One HTTP call to the spectune API, and the cap of the back-off between retries of it.
    api_s: float = Field(default=30.0, gt=0, le=600)
    api_retry_max_s: float = Field(default=60.0, gt=0, le=3600)


class WorkerConfig(_Section):
    """The whole file.  Paths are absolute once `load_config` has returned."""

    api_url: str
    token_file: Path
    worker_id: str = Field(default_factory=socket.gethostname)
    # GPU indices this worker may use (CUDA_VISIBLE_DEVICES for the engine); None: all of them.
    gpus: list[int] | None = None
    engine: EngineSection = Field(default_factory=EngineSection)
    timeouts: TimeoutsSection = Field(default_factory=TimeoutsSection)
    # The model registry: name (as a study spells it) -> local path.  Only these are ever launched.
    models: dict[str, Path] = Field(default_factory=dict)
    # Folder holding prompt files a workload may name (besides the built-in sets).
    prompt_dir: Path | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    outbox_dir: Path = Path("outbox")
    # Wait after "no work" (204), doubled up to idle_poll_max_s while the API stays idle.
    idle_poll_s: float = Field(default=5.0, gt=0, le=3600)
    idle_poll_max_s: float = Field(default=60.0, gt=0, le=3600)

    @field_validator("api_url")
    @classmethod
    def _api_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{v!r} is not an http(s) URL; use e.g. 'https://spectune.example.com'")
        if parts.username or parts.password:
            raise ValueError("put no credentials in the URL; the worker token goes in token_file")
        if parts.query or parts.fragment:
            raise ValueError("give the base URL only, without '?query' or '#fragment'")
        return v.rstrip("/")

    @field_validator("worker_id")
    @classmethod
    def _worker_id(cls, v: str) -> str:
        if not WORKER_ID_RE.match(v):
            raise ValueError(f"{v!r} is not a valid worker id: use up to 128 letters, digits, '.', '_' or '-'")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("give at least one GPU index, or leave `gpus` out to use every GPU")
        if any(i < 0 or i > 1023 for i in v) or len(set(v)) != len(v):
            raise ValueError(f"GPU indices must be distinct integers >= 0, got {v}")
        return v

    @field_validator("models")
    @classmethod
    def _models(cls, v: dict[str, Path]) -> dict[str, Path]:
        for name in v:
            if not MODEL_NAME_RE.match(name) or ".." in name:
                raise ValueError(
                    f"{name!r} is not a model name; registry names use letters, digits, '.', '_', '/' or '-' "
                    '(quote it in TOML: "org/model" = "/models/org/model")'
                )
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 64:
            raise ValueError("at most 64 labels")
        for key, value in v.items():
            if not LABEL_KEY_RE.match(key):
                raise ValueError(f"label key {key!r}: use letters, digits, '.', '_', '/' or '-'")
            if len(value) > 128:
                raise ValueError(f"label {key!r}: values are at most 128 characters")
        return v

    @model_validator(mode="after")
    def _poll(self) -> WorkerConfig:
        if self.idle_poll_max_s < self.idle_poll_s:
            raise ValueError("idle_poll_max_s must be >= idle_poll_s")
        return self


def _loc(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = _loc(e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key (a typo?); see workers/worker.example.toml for the keys")
        elif e["type"] == "missing":
            lines.append(f"{where}: required key is missing")
        else:
            msg = str(e["msg"]).removeprefix("Value error, ")
            lines.append(f"{where}: {msg}")
    return "\n  ".join(lines)


def _resolve(base: Path, p: Path) -> Path:
    p = p.expanduser()
    return p if p.is_absolute() else (base / p)


def _resolve_python(base: Path, p: Path) -> Path:
    if p.parent == Path("."):  # a bare name such as "python3": look it up on PATH
        found = shutil.which(str(p))
        if found is None:
            raise ConfigError(f"engine.python: {str(p)!r} is not on PATH; give the interpreter's full path")
        return Path(found)
    # No resolve(): a venv's bin/python is a symlink, and following it would lose the venv.
    path = _resolve(base, p)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ConfigError(f"engine.python: {path} is not an executable file; point it at the interpreter with SGLang")
    return path


def _check_paths(cfg: WorkerConfig, base: Path) -> WorkerConfig:
    token_file = _resolve(base, cfg.token_file)
    if not token_file.is_file():
        raise ConfigError(
            f"token_file: {token_file} does not exist; create it with `spectune token create --role worker` "
            "on the API host and copy it here (mode 0600)"
        )
    models: dict[str, Path] = {}
    for name, path in cfg.models.items():
        full = _resolve(base, path)
        if not full.exists():
            raise ConfigError(f"models.{name}: {full} does not exist; fix the path or remove the entry")
        models[name] = full
    prompt_dir = None
    if cfg.prompt_dir is not None:
        prompt_dir = _resolve(base, cfg.prompt_dir)
        if not prompt_dir.is_dir():
            raise ConfigError(f"prompt_dir: {prompt_dir} is not a directory")
    engine = cfg.engine.model_copy(
        update={"python": _resolve_python(base, cfg.engine.python), "log_dir": _resolve(base, cfg.engine.log_dir)}
    )
    outbox_dir = _resolve(base, cfg.outbox_dir)
    for key, folder in (("outbox_dir", outbox_dir), ("engine.log_dir", engine.log_dir)):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{key}: cannot create {folder} ({e.strerror}); create it writable for this user") from e
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}: {folder} is not writable by this user")
    return cfg.model_copy(
        update={
            "token_file": token_file,
            "models": models,
            "prompt_dir": prompt_dir,
            "engine": engine,
            "outbox_dir": outbox_dir,
        }
    )


def parse_config(data: dict[str, Any], *, base_dir: Path) -> WorkerConfig:
    """Validate already-parsed TOML data; relative paths are taken from `base_dir`."""
    try:
        cfg = WorkerConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid worker config:\n  {_describe(e)}") from e
    return _check_paths(cfg, base_dir)


def load_config(path: Path) -> WorkerConfig:
    """Read and validate a worker config file.  Raises ConfigError with a message for the operator."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read worker config {path}: {e.strerror}") from e
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from e
    try:
        return parse_config(data, base_dir=path.resolve().parent)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e


def read_token(cfg: WorkerConfig) -> str:
    """The bearer token from `token_file` (surrounding whitespace stripped).  Never log the result."""
    try:
        st = cfg.token_file.stat()
        token = cfg.token_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"token_file: cannot read {cfg.token_file} ({e})") from e
    if not token or any(c.isspace() for c in token):
        raise ConfigError(f"token_file: {cfg.token_file} must hold exactly one token on one line")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("token file %s is readable by other users; run: chmod 600 %s", cfg.token_file, cfg.token_file)
    return token


def read_model_registry(path: Path) -> dict[str, str]:
    """Only the `[models]` registry of a worker config (registry name -> absolute local path).

    For printing a launch command on a worker host (`spectune study best --worker-config`): it
    reads nothing else and creates nothing, so any user who can read the file may call it.
    """
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read worker config {path}: {e.strerror}") from e
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from e
    models = data.get("models") or {}
    if not isinstance(models, dict) or not all(isinstance(v, str) for v in models.values()):
        raise ConfigError(f"{path}: [models] must map registry names to paths")
    base = path.resolve().parent
    return {str(name): str(_resolve(base, Path(p))) for name, p in models.items()}
