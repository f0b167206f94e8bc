"""`spectune demo`: a whole study on one machine, with nothing but Python.

The API runs on a SQLite file, two workers drive the simulated engine (which speaks SGLang's
protocol and is calibrated on published measurements), and a demo study runs to its budget.
Every process is started here, as a real subprocess talking real HTTP on 127.0.0.1, and stopped
here: the demo exercises exactly what a cluster deployment runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import typer

from api.documents import StudyDocument, TrialRow
from api.outcomes import headline
from optimizer.space import SpecConfig
from optimizer.study_state import Outcome
from workers.lifeline import child_env

# The simulated engine runs this much faster than real time (all rates scale equally, so the
# speedups are unchanged) and starts up in a fraction of the real time.
SIM_SPEED = 20.0
SIM_TIME_SCALE = 0.004
DEMO_DEADLINE_S = 280.0  # the demo must finish well inside 5 minutes on 2 cores
N_WORKERS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _demo_spec(name: str, landscape: str, max_trials: int) -> dict[str, Any]:
    from spectune_sim.landscapes import get_landscape

    # The landscape's own tensor parallelism ("moe-pcie" is a 1T MoE at TP8), so the printed
    # launch command and the GPU-hours are those of the server simulated.
    tp_size = get_landscape(landscape).tp_size
    return {
        "name": name,
        "model": {"target": landscape, "draft": f"{landscape}-eagle3", "attention_backend": "fa3", "tp_size": tp_size},
        "search_space": {
            "num_steps": {"low": 1, "high": 10},
            "topk": [1, 2, 4, 8],
            "num_draft_tokens": {"low": 2, "high": 64},
        },
        "workload": {"output_len": 128, "num_prompts": 16, "concurrency": [1], "warmup_requests": 2, "repeats": 3},
        "budget": {"max_trials": max_trials},
        "sampler": "auto",
        "seed": 0,
    }


def _write_worker_config(workdir: Path, i: int, api_url: str, landscape: str) -> Path:
    wdir = workdir / f"worker-{i}"
    wdir.mkdir(parents=True, exist_ok=True)
    # The simulated engine reads its landscape from the model path's last component; the
    # folders exist because the worker checks every registry path at start-up.
    models = workdir / "sim-models"
    for name in (landscape, f"{landscape}-eagle3"):
        (models / name).mkdir(parents=True, exist_ok=True)
    cfg = wdir / "worker.toml"
    env = {
        "SPECTUNE_SIM_SPEED": str(SIM_SPEED),
        "SPECTUNE_SIM_TIME_SCALE": str(SIM_TIME_SCALE),
        "SPECTUNE_SIM_HOST_ID": f"demo-host-{i}",
        "SPECTUNE_SIM_SEED": str(i),
    }
    env_lines = "\n".join(f'{k} = "{v}"' for k, v in env.items())
    cfg.write_text(
        f"""# Written by `spectune demo`: a worker driving the simulated engine.
api_url = "{api_url}"
token_file = "worker.token"
worker_id = "demo-worker-{i}"
outbox_dir = "outbox"
idle_poll_s = 0.5
idle_poll_max_s = 2

[engine]
python = "{sys.executable}"
module = "spectune_sim"
port = {_free_port()}
sglang_version = "0.5.23"
log_dir = "logs"

[engine.env]
{env_lines}

[timeouts]
startup_s = 120
stop_s = 10
gpu_release_s = 10
request_s = 120

[models]
"{landscape}" = "{models}/{landscape}"
"{landscape}-eagle3" = "{models}/{landscape}-eagle3"

[labels]
demo = "true"
"""
    )
    return cfg


@contextmanager
def _process(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A child in its own process group; on exit SIGTERM, a bounded wait, then SIGKILL.

    The child also follows the demo if the demo is killed outright (workers/lifeline.py).
    """
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=child_env({**os.environ, "TZ": "UTC", **(env or {})}),
            start_new_session=True,
        )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the API exited with status {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the API did not come up within {timeout:.0f} s; see {log_path}")


def _progress_line(elapsed: float, study: StudyDocument) -> str:
    t = study.trials
    best = study.best
    best_s = "none yet"
    if best:
        c = best.config
        what = "SGLang's adaptive server" if best.adaptive else ""
        best_s = f"{best.speedup or 0.0:.3f}x ({what or f'steps {c.num_steps}, topk {c.topk}, draft tokens {c.num_draft_tokens}'})"
    return (
        f"[{elapsed:5.0f} s] baselines measured {study.baselines_measured} | trials: "
        f"{t.COMPLETE} done, {t.RUNNING} running, {t.FAIL} failed | best so far {best_s}"
    )


def _config_text(c: SpecConfig) -> str:
    return f"num_steps={c.num_steps} topk={c.topk} num_draft_tokens={c.num_draft_tokens}"


def _print_result(study: StudyDocument, trials: list[TrialRow], db_url: str, wall_s: float) -> None:
    echo = typer.echo
    echo("")
    echo(f"Study {study.name}: {study.state} ({study.finish_reason or 'deadline'}) in {wall_s:.0f} s")
    launched = [t for t in trials if t.duplicate_of is None and t.inferred_from is None]
    measured = [t for t in launched if t.state == "COMPLETE" and t.feasible]
    failed = [t for t in launched if t.state == "COMPLETE" and not t.feasible]
    pruned = [t for t in launched if t.state == "PRUNED"]
    echo(
        f"  {study.configurations_launched} server restarts: {len(measured)} measured, "
        f"{len(pruned)} pruned early, {len(failed)} could not run; every worker measured its baseline first"
    )
    echo(f"  cost: {study.cost.summary}")
    # The answer is the confirmed winner; without confirmation, the best trial of the search.
    answer = study.winner or study.best
    if not answer:
        echo("  no configuration finished; see the logs under the demo folder")
        return
    echo("")
    echo(headline(study))
    echo(study.verdict)
    for row in study.confirmation:
        iv = row.speedup_interval
        band = f" ({iv.low:.3f}-{iv.high:.3f})" if iv else ""
        got = f"{row.speedup:.3f}x{band}" if row.speedup is not None else row.state
        config = "?" if row.config is None else _config_text(row.config)
        if row.adaptive:
            echo(f"  launched the adaptive answer as printed ({config}): {got}")
        else:
            echo(f"  confirmed {config}: search {row.search_speedup or 0.0:.3f}x, re-measured {got}")
    if answer.adaptive:
        echo(f"  answer: {answer.label()}, lease {answer.lease_id} on {answer.confirmed_on}")
    else:
        echo(f"  answer: {_config_text(answer.config)} (trial {answer.trial_number})")
    if study.best_static is not None:
        echo(f"  the best static configuration: {study.best_static.label()}: {study.best_static.speedup or 0.0:.3f}x")
    for level, lv_speedup in (answer.speedup_by_level or {}).items():
        iv = answer.speedup_interval_by_level.get(level)
        spread = f", 95% interval {iv.low:.3f}-{iv.high:.3f}" if iv else ""
        lv = next((x for x in answer.levels or [] if str(x.concurrency) == level), None)
        al = f", accept length {lv.accept_length:.2f}" if lv and lv.accept_length else ""
        echo(f"  concurrency {level}: {lv_speedup:.3f}x the speed without speculation{spread}{al}")
    echo("")
    dep, command, note = study.deployment, study.printed_command(), study.printed_command_note()
    if study.outcome == Outcome.NO_ANSWER:
        # As `spectune study best`: no answer prints no command a reader could deploy.
        echo(f"No command to launch: {study.verdict if dep is None else 'the study has no answer (above)'}")
    elif dep is None or command is None:
        echo(f"No command to launch: {note}")
    else:
        echo(f"Launch it ({dep.reason or 'the answer'}; replace the <local path of ...> placeholders):")
        if note:
            echo(f"  # {note}")
        echo(f"  # {dep.load_line}")  # right above the command: deployed as printed, it admits only this
        for line in command.splitlines():
            echo(f"  {line}")
    echo("")
    echo("Look at it again in the dashboard (behind spectune's login):")
    echo(f"  spectune server --database-url {db_url}   # then open http://127.0.0.1:8000/login")
    echo(f"  and sign in with the token in {Path(db_url.removeprefix('sqlite:///')).parent / 'user.token'}")


def run_demo(
    *, workdir: Path, landscape: str = "moe-pcie", max_trials: int = 20, deadline_s: float = DEMO_DEADLINE_S
) -> int:
    """Run the demo; returns the process exit status."""
    from api.auth import create_token
    from api.db import make_engine, make_sessionmaker
    from api.schema import upgrade

    started = time.monotonic()
    # SIGTERM (a time-out, `kill`) unwinds like Ctrl-C, so every child is stopped on the way out.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    db_path = workdir / "spectune.db"
    if db_path.exists():
        db_path.unlink()  # a demo starts from scratch
    for suffix in ("-wal", "-shm"):
        Path(f"{db_path}{suffix}").unlink(missing_ok=True)
    db_url = f"sqlite:///{db_path}"
    typer.echo(f"spectune demo: API on {db_url}, {N_WORKERS} workers driving the simulated '{landscape}' engine")
    upgrade(db_url)
    engine = make_engine(db_url)
    factory = make_sessionmaker(engine)
    _, user_token = create_token(factory, "user", "demo-user")
    token_path = workdir / "user.token"
    token_path.write_text(user_token + "\n")
    token_path.chmod(0o600)
    # One token per host, as a fleet has them: a confirmation counts only from another token than
    # the one that found its candidate (issue 35).
    worker_tokens = [create_token(factory, "worker", f"demo-worker-{i}")[1] for i in range(N_WORKERS)]
    engine.dispose()

    port = _free_port()
    api_url = f"http://127.0.0.1:{port}"
    api_log = workdir / "api.log"
    study_name = f"demo-{landscape}"
    headers = {"Authorization": f"Bearer {user_token}"}
    with ExitStack() as stack:
        api = stack.enter_context(
            _process(
                [sys.executable, "-m", "api.cli", "server", "--database-url", db_url, "--port", str(port)],
                api_log,
                {
                    "SPECTUNE_HEARTBEAT_INTERVAL_S": "2",
                    "SPECTUNE_LEASE_TTL_S": "20",
                    "SPECTUNE_ARTIFACT_DIR": str(workdir / "artifacts"),
                },
            )
        )
        _wait_healthy(api_url, api, api_log)
        typer.echo(f"watch it live: {api_url}/login (sign in with the token in {token_path})")
        r = httpx.post(
            f"{api_url}/v1/studies", json=_demo_spec(study_name, landscape, max_trials), headers=headers, timeout=60
        )
        if r.status_code != 201:
            typer.secho(f"error: could not create the demo study: {r.text}", err=True, fg=typer.colors.RED)
            return 2
        workers: list[tuple[subprocess.Popen[bytes], Path]] = []
        for i in range(N_WORKERS):
            cfg = _write_worker_config(workdir, i, api_url, landscape)
            token_file = cfg.parent / "worker.token"
            token_file.write_text(worker_tokens[i] + "\n")
            token_file.chmod(0o600)
            log_path = cfg.parent / "worker.log"
            proc = stack.enter_context(
                _process([sys.executable, "-m", "api.cli", "worker", "--config", str(cfg)], log_path)
            )
            workers.append((proc, log_path))
        last = ""
        raw: dict[str, Any] = {}
        while time.monotonic() - started < deadline_s:
            raw = httpx.get(f"{api_url}/v1/studies/{study_name}", headers=headers, timeout=30).json()
            line = _progress_line(time.monotonic() - started, StudyDocument.model_validate(raw))
            if line.split("]", 1)[1] != last:
                typer.echo(line)
                last = line.split("]", 1)[1]
            if raw["state"] != "running":
                break
            if all(p.poll() is not None for p, _ in workers):
                tail = workers[0][1].read_text()[-1500:]
                typer.secho(f"error: every worker exited; the first one's log ends with:\n{tail}", err=True)
                return 1
            time.sleep(1.0)
        else:
            typer.echo("demo deadline reached: stopping the study")
            raw = httpx.post(f"{api_url}/v1/studies/{study_name}/stop", headers=headers, timeout=30).json()
        raw_trials = httpx.get(f"{api_url}/v1/studies/{study_name}/trials", headers=headers, timeout=30).json()
        typer.echo("stopping workers and their engines...")
    study = StudyDocument.model_validate(raw)
    _print_result(study, [TrialRow.model_validate(t) for t in raw_trials], db_url, time.monotonic() - started)
    (workdir / "result.json").write_text(json.dumps({"study": raw, "trials": raw_trials}, indent=2, default=str))
    typer.echo(f"(logs and the full result are in {workdir})")
    return 0 if study.best else 1
