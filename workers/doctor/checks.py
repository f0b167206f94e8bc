"""`spectune doctor`'s checks of a GPU host, each one line: `ok`, `FAIL` (with what to do) or `skip`.

Unlike the worker's start-up, which stops at the first problem (workers/config.py,
workers/preflight.py), the doctor goes on after a failure so that one run names every problem of
a host; a check that depends on a failed one says it was skipped and why.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from optimizer.sglang import ServerSettings, build_server_args
from optimizer.space import SpecConfig
from workers.config import WorkerConfig, _describe, _resolve, _resolve_python
from workers.errors import ConfigError
from workers.gpu import GpuProbe
from workers.launcher.config import EngineConfig, server_env
from workers.launcher.version import detect_sglang_version
from workers.preflight import check_engine_imports, check_gpus

Status = Literal["ok", "FAIL", "skip"]
_MIB_PER_GIB = 1024.0
# `python -m sglang.launch_server ... --help` imports SGLang (seconds to a minute on a GPU host).
HELP_TIMEOUT_S = 300.0
_LONG_OPTION_RE = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


@dataclass(frozen=True)
class Line:
    status: Status
    check: str
    message: str

    def render(self) -> str:
        return f"{self.status:<4} {self.check}: {self.message}"


@dataclass
class HostState:
    """What the checks found, for the checks after them and for the bundle."""

    cfg: WorkerConfig | None = None
    python: Path | None = None
    models: dict[str, Path] = field(default_factory=dict)  # registry paths that exist
    token: str | None = None
    version: str | None = None
    gpus: list[dict[str, Any]] = field(default_factory=list)
    driver: str | None = None
    lines: list[Line] = field(default_factory=list)
    # Hears each line as its check ends (a launch can take minutes on a large model).
    sink: Callable[[str], None] = lambda _line: None

    def add(self, status: Status, check: str, message: str) -> None:
        line = Line(status, check, " ".join(message.split()))
        self.lines.append(line)
        self.sink(line.render())

    @property
    def failed(self) -> bool:
        return any(line.status == "FAIL" for line in self.lines)


def load(path: Path, state: HostState) -> WorkerConfig | None:
    """The config's schema (every key's type and range); paths are checked one by one afterwards."""
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        state.add("FAIL", "config", f"cannot read {path}: {e.strerror}")
        return None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        state.add("FAIL", "config", f"{path} is not valid TOML: {e}")
        return None
    try:
        cfg = WorkerConfig.model_validate(data)
    except ValidationError as e:
        state.add("FAIL", "config", f"{path}: {_describe(e)}; see workers/worker.example.toml")
        return None
    state.add("ok", "config", f"{path} (worker {cfg.worker_id}, API {cfg.api_url})")
    return cfg


def check_files(cfg: WorkerConfig, base: Path, state: HostState) -> WorkerConfig:
    """Interpreter, token file, registry paths and log folder; returns the config with absolute paths."""
    try:
        state.python = _resolve_python(base, cfg.engine.python)
        state.add("ok", "engine.python", str(state.python))
    except ConfigError as e:
        state.add("FAIL", "engine.python", str(e).removeprefix("engine.python: "))
    token_file = _resolve(base, cfg.token_file)
    try:
        mode = token_file.stat().st_mode
        token = token_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        state.add(
            "FAIL",
            "token_file",
            f"cannot read {token_file} ({e}); create it with `spectune token create --role worker`",
        )
    else:
        state.token = token or None
        if not token or any(c.isspace() for c in token):
            state.add("FAIL", "token_file", f"{token_file} must hold exactly one token on one line")
        elif mode & (stat.S_IRWXG | stat.S_IRWXO):
            state.add("FAIL", "token_file", f"{token_file} is readable by other users; run: chmod 600 {token_file}")
        else:
            state.add("ok", "token_file", f"{token_file} (mode 0600)")
    if not cfg.models:
        state.add("FAIL", "models", "the registry is empty; add [models] name = path for the models studies name")
    for name, path in cfg.models.items():
        full = _resolve(base, path)
        if full.exists():
            state.models[name] = full
            state.add("ok", f"models.{name}", str(full))
        else:
            state.add("FAIL", f"models.{name}", f"{full} does not exist; fix the path in [models] or remove the entry")
    log_dir = _resolve(base, cfg.engine.log_dir)
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(log_dir, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable by this user")
        state.add("ok", "engine.log_dir", str(log_dir))
    except OSError as e:
        state.add(
            "FAIL", "engine.log_dir", f"cannot write to {log_dir} ({e.strerror}); create it writable for this user"
        )
    python = state.python or cfg.engine.python
    return cfg.model_copy(
        update={
            "token_file": token_file,
            "models": {n: _resolve(base, p) for n, p in cfg.models.items()},
            "engine": cfg.engine.model_copy(update={"python": python, "log_dir": log_dir}),
        }
    )


def check_engine(engine: EngineConfig, state: HostState) -> None:
    """The engine's module imports, and its SGLang version is one spectune supports."""
    if state.python is None:
        state.add("skip", "engine.module", "the interpreter above is unusable")
        state.add("skip", "sglang", "the interpreter above is unusable")
        return
    env = server_env(engine)
    try:
        check_engine_imports(engine.python, engine.module, env=env)
        state.add("ok", "engine.module", f"{engine.module} imports with {engine.python}")
    except ConfigError as e:
        state.add("FAIL", "engine.module", str(e).removeprefix("engine.module: "))
    try:
        state.version = detect_sglang_version(engine.python, engine.sglang_version, env=env)
    except ConfigError as e:
        state.add("FAIL", "sglang", str(e))
        return
    source = "engine.sglang_version" if engine.sglang_version else f"installed for {engine.python}"
    state.add("ok", "sglang", f"{state.version} ({source}), on the supported list")


def check_gpu_host(probe: GpuProbe | None, cfg: WorkerConfig, tp: int, state: HostState) -> None:
    """NVML: the configured GPUs exist, there are enough for the launch, and nothing else holds them."""
    if probe is None:
        state.add(
            "skip",
            "gpus",
            "NVML is not available (no NVIDIA driver, or pynvml missing: pip install nvidia-ml-py); GPU count, "
            "free memory and other processes were not checked",
        )
        return
    state.driver = probe.driver_version()
    try:
        check_gpus(probe, cfg.gpus, cfg.labels)
    except ConfigError as e:
        state.add("FAIL", "gpus", str(e).removeprefix("gpus: "))
        return
    devices = {d.index: d for d in probe.devices()}
    usable = sorted(cfg.gpus) if cfg.gpus is not None else sorted(devices)
    if tp > len(usable):
        state.add(
            "FAIL",
            "gpus",
            f"the launch needs {tp} GPU(s) (tensor parallel {tp}) but this worker may use {len(usable)} "
            f"({usable}); list more in `gpus`, or pass --tp {len(usable)}",
        )
    busy: dict[int, list[str]] = {}
    for p in probe.compute_processes():
        if p.gpu_index in usable:
            held = "unknown" if p.used_mib is None else f"{p.used_mib / _MIB_PER_GIB:.1f} GiB"
            busy.setdefault(p.gpu_index, []).append(f"pid {p.pid} ({held})")
    for index in usable:
        d = devices[index]
        free = (d.memory_total_mib - d.memory_used_mib) / _MIB_PER_GIB
        state.gpus.append({"index": index, "name": d.name, "total_gib": round(d.memory_total_mib / _MIB_PER_GIB, 1)})
        if index in busy:
            state.add(
                "FAIL",
                f"gpu {index}",
                f"{d.name}: other processes hold it ({'; '.join(busy[index])}); stop them (nvidia-smi shows them) "
                "or leave this GPU out of `gpus`: a benchmark next to them measures them too",
            )
        else:
            state.add("ok", f"gpu {index}", f"{d.name}, {free:.1f} of {d.memory_total_mib / _MIB_PER_GIB:.1f} GiB free")


def first_launches(target: str, draft: str | None, tp: int) -> list[ServerSettings]:
    """The study's first launch (the baseline) and, with a draft, a speculative one like its trials'."""
    baseline = ServerSettings(target=target, tp_size=tp, max_running_requests=8, cuda_graph_bs=(1, 2, 4, 8))
    if draft is None:
        return [baseline]
    chain = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    return [baseline, baseline.model_copy(update={"draft": draft, "speculative": chain})]


def server_argv(engine: EngineConfig, settings: ServerSettings, version: str, models: dict[str, Path]) -> list[str]:
    flags = build_server_args(
        settings,
        version=version,
        model_path=str(models[settings.target]),
        draft_model_path=None if settings.draft is None else str(models[settings.draft]),
        host=engine.host,
        port=engine.port,
    )
    return [engine.python, "-m", engine.module, *flags]


def check_argv_parses(engine: EngineConfig, argvs: Sequence[list[str]], state: HostState) -> bool:
    """Each argv, with `--help` appended, through the engine's own interpreter (a list, no shell).

    argparse reads every option string before it acts on `--help`, so an ambiguous abbreviation, a
    bad value or a wrong choice before it still fails (exit 2); an unknown flag would only fail at
    the end, so each flag is also looked for, exactly, in the help text.
    """
    ok = True
    for argv in argvs:
        what = "speculative" if "--speculative-algorithm" in argv else "baseline"
        try:
            done = subprocess.run(
                [*argv, "--help"],
                capture_output=True,
                text=True,
                timeout=HELP_TIMEOUT_S,
                env=server_env(engine),
                stdin=subprocess.DEVNULL,
                check=False,
                start_new_session=True,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            state.add("FAIL", f"argv {what}", f"`{engine.module} --help` did not run: {e}")
            ok = False
            continue
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            reason = lines[-1][:400] if lines else f"exit status {done.returncode}"
            state.add("FAIL", f"argv {what}", f"the installed engine refuses spectune's flags: {reason}")
            ok = False
            continue
        known = set(_LONG_OPTION_RE.findall(done.stdout))
        missing = [a for a in argv if a.startswith("--") and a not in known]
        if missing:
            state.add(
                "FAIL",
                f"argv {what}",
                f"the installed engine has no {', '.join(missing)}; is engine.sglang_version "
                "the version really installed?",
            )
            ok = False
        else:
            state.add("ok", f"argv {what}", f"{len([a for a in argv if a.startswith('--')])} flags parse with --help")
    return ok
