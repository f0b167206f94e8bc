"""`spectune doctor --config worker.toml [--launch]`: check a GPU host before its first real run.

Prints one line per check (`ok`, `FAIL` with what to do, `skip` with why), writes a support
bundle (workers/doctor/bundle.py), and exits 0 when nothing failed, 2 otherwise.  `--launch`
also starts the study's first server (the baseline) once through the worker's own launcher,
reads `/server_info` and `/metrics`, and stops it.
"""

from __future__ import annotations

import argparse
import platform
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from workers.doctor.bundle import REDACTED, SECRET_NAME_RE, Redactor, write_bundle
from workers.doctor.checks import (
    HostState,
    check_argv_parses,
    check_engine,
    check_files,
    check_gpu_host,
    first_launches,
    load,
    server_argv,
)
from workers.errors import LaunchError, WorkerError
from workers.gpu import GpuProbe, open_probe
from workers.inventory import spectune_version
from workers.launcher import Launcher, RunningServer
from workers.launcher.config import EngineConfig
from workers.lifeline import exit_with_parent
from workers.main import engine_config

EXIT_OK = 0
EXIT_FAILED = 2
_METRICS_TIMEOUT_S = 10.0
_LOG_TAIL_BYTES = 8000


def parser(prog: str = "spectune doctor") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Check this GPU host for its first real run: the engine's interpreter and SGLang version, "
        "the GPUs, the model registry, that spectune's first launch parses with the installed SGLang, and "
        "(--launch) one real start of the baseline server.  Writes a support bundle with tokens and paths "
        "redacted.  Exit 0: every check passed; 2: something failed (each FAIL line says what to do).",
    )
    p.add_argument("-c", "--config", type=Path, required=True, help="the worker's TOML file")
    p.add_argument("--target", help="registry name of the model to launch (default: the registry's first)")
    p.add_argument("--draft", help="registry name of its EAGLE-3 draft: also checks a speculative launch's flags")
    p.add_argument("--tp", type=int, help="tensor-parallel size of the launch (default: the GPUs this worker may use)")
    p.add_argument("--launch", action="store_true", help="start the baseline server once, read it back, stop it")
    p.add_argument(
        "--bundle", type=Path, default=Path("spectune-doctor.json"), help="where to write the support bundle"
    )
    return p


def _pick_model(state: HostState, name: str | None, role: str) -> str | None:
    cfg = state.cfg
    assert cfg is not None
    if name is None:
        return next(iter(cfg.models), None) if role == "target" else None
    if name not in cfg.models:
        state.add(
            "FAIL", role, f"{name!r} is not in the registry ({', '.join(cfg.models) or 'empty'}); add it to [models]"
        )
        return None
    return name


def _launch_once(
    engine: EngineConfig, probe: GpuProbe | None, argv_settings: Any, state: HostState, doc: dict[str, Any]
) -> None:
    launcher = Launcher(engine, gpu_probe=probe)
    settings = argv_settings
    assert state.version is not None
    running: RunningServer | None = None
    try:
        running = launcher.launch(
            settings, version=state.version, model_path=str(state.models[settings.target]), draft_model_path=None
        )
        doc["launch"] = {
            "startup_s": round(running.startup_s, 1),
            "server_info": running.server_info,
            "effective": running.effective,
            "mismatches": {k: list(v) for k, v in running.mismatches.items()},
        }
        try:
            metrics = httpx.get(f"{running.base_url}/metrics", timeout=_METRICS_TIMEOUT_S)
            metric_lines = [line for line in metrics.text.splitlines() if line and not line.startswith("#")]
        except httpx.HTTPError as e:
            state.add(
                "FAIL", "launch", f"the server started but GET /metrics failed ({e}); is --enable-metrics honoured?"
            )
        else:
            doc["launch"]["metrics_head"] = metric_lines[:40]
            if metrics.status_code != 200 or not metric_lines:
                state.add("FAIL", "launch", f"the server started but GET /metrics answered {metrics.status_code}")
            else:
                known = "; effective settings read back" if running.effective else "; /server_info said nothing"
                state.add(
                    "ok",
                    "launch",
                    f"baseline server up in {running.startup_s:.1f} s{known}, /metrics has {len(metric_lines)} samples",
                )
        doc["launch"]["log_tail"] = running.log_tail(_LOG_TAIL_BYTES)
    except LaunchError as e:
        doc["launch"] = {"failure": e.kind, "message": e.message, "log_tail": e.log_tail}
        state.add("FAIL", "launch", f"{e.kind}: {e.message}; the bundle has the log's tail (send it with your report)")
    except WorkerError as e:
        doc["launch"] = {"failure": type(e).__name__, "message": str(e)}
        state.add("FAIL", "launch", str(e))
    finally:
        try:
            launcher.stop()
        except WorkerError as e:
            state.add("FAIL", "stop", f"the server did not stop cleanly: {e}")


def run(
    config: Path,
    *,
    probe: GpuProbe | None,
    target: str | None = None,
    draft: str | None = None,
    tp: int | None = None,
    launch: bool = False,
    bundle: Path = Path("spectune-doctor.json"),
    out: Callable[[str], None] = print,
) -> int:
    """Every check, one line each through `out` as it ends; the bundle; EXIT_OK or EXIT_FAILED."""
    state = HostState(sink=out)
    doc: dict[str, Any] = {
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "versions": {"spectune": spectune_version(), "worker_python": platform.python_version()},
    }
    secrets: list[str] = []
    cfg = load(config, state)
    engine: EngineConfig | None = None
    if cfg is not None:
        cfg = check_files(cfg, config.resolve().parent, state)
        state.cfg = cfg
        secrets += [v for k, v in cfg.engine.env.items() if SECRET_NAME_RE.search(k)]
        engine = engine_config(cfg)
        check_engine(engine, state)
        chosen_tp = tp or (len(cfg.gpus) if cfg.gpus else len(probe.devices()) if probe is not None else 1)
        check_gpu_host(probe, cfg, chosen_tp, state)
        target_name = _pick_model(state, target, "target")
        draft_name = _pick_model(state, draft, "draft")
        launches = [] if target_name is None else first_launches(target_name, draft_name, chosen_tp)
        names_ok = all(s.target in state.models and (s.draft is None or s.draft in state.models) for s in launches)
        if state.version is None or not launches or not names_ok:
            state.add("skip", "argv", "needs a usable interpreter, a supported SGLang and the models' paths (above)")
            if launch:
                state.add("skip", "launch", "not started: fix the failures above first")
        else:
            argvs = [server_argv(engine, s, state.version, state.models) for s in launches]
            doc["argv"] = argvs
            parsed = check_argv_parses(engine, argvs, state)
            if launch and parsed and not state.failed:
                _launch_once(engine, probe, launches[0], state, doc)
            elif launch:
                state.add("skip", "launch", "not started: fix the failures above first")
        doc["settings"] = {
            **cfg.model_dump(mode="json", exclude={"token_file"}),
            "token_file": REDACTED,
            "engine": {
                **cfg.engine.model_dump(mode="json"),
                "env": {k: (REDACTED if SECRET_NAME_RE.search(k) else v) for k, v in cfg.engine.env.items()},
            },
            "tp": chosen_tp,
        }
    if state.token:
        secrets.append(state.token)
    doc["versions"].update({"sglang": state.version, "nvidia_driver": state.driver})
    doc["gpus"] = state.gpus
    doc["checks"] = [line.render() for line in state.lines]
    redactor = Redactor(secrets=secrets, models=state.models)
    try:
        write_bundle(bundle, doc, redactor)
        out(f"bundle: {bundle} (tokens and paths redacted; attach it to a report of a failed run)")
    except OSError as e:
        out(f"FAIL bundle: cannot write {bundle} ({e.strerror}); pass --bundle with a writable path")
        return EXIT_FAILED
    return EXIT_FAILED if state.failed else EXIT_OK


def _print(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()  # each line as its check ends: a launch can take minutes


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    # SystemExit unwinds through the launch and its `finally`: the baseline server is stopped
    # (a SIGTERM'd process would otherwise die without running it and leave the server behind).
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None, prog: str = "spectune doctor") -> int:
    args = parser(prog).parse_args(argv)
    if args.tp is not None and not 1 <= args.tp <= 64:
        parser(prog).error(f"--tp {args.tp}: give a tensor-parallel size from 1 to 64")
    exit_with_parent()  # a doctor whose parent is gone stops, and with it its server
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    probe = open_probe()
    try:
        return run(
            args.config,
            probe=probe,
            target=args.target,
            draft=args.draft,
            tp=args.tp,
            launch=args.launch,
            bundle=args.bundle,
            out=_print,
        )
    finally:
        if probe is not None:
            probe.close()
