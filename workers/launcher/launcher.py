"""Start, watch and stop one SGLang server at a time (docs/design.md "The worker"; issue 3).

One `Launcher` per engine slot.  `launch()` stops the previous server (waiting for its GPU memory),
starts the new one in its own session with its output in a per-launch log file, waits for
readiness, reads the effective settings back, and returns a `RunningServer`.  Every failure comes
out as a `LaunchError` whose kind the lease report carries, after the server has been stopped.
"""

from __future__ import annotations

import itertools
import logging
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from optimizer.sglang import ServerSettings
from workers.errors import ConfigError, LaunchCancelled, LaunchError, WorkerError
from workers.gpu import GpuProbe
from workers.launcher.argv import build_argv
from workers.launcher.classify import classify_exit, describe_returncode
from workers.launcher.config import EngineConfig, server_env
from workers.launcher.gpu_release import wait_gpu_release
from workers.launcher.processes import group_members, stop_group
from workers.launcher.readiness import Outcome, port_open, wait_until_ready
from workers.launcher.server_info import effective_settings, fetch_server_info, find_mismatches

logger = logging.getLogger("spectune.worker.launcher")

# Launch logs kept in log_dir (oldest pruned): a busy host launches thousands of servers.
KEEP_LOGS = 200
_LOG_GLOB = "server-*.log"
_ADAPTIVE_GLOB = "server-*.adaptive.json"
# A port held by a stranger may be in the middle of closing; wait this long before giving up.
_PORT_FREE_WAIT_S = 5.0
_SCAN_EVERY_S = 1.0


def read_tail(path: Path, max_bytes: int = 8000) -> str:
    """The last `max_bytes` of a log file as text ("" when it cannot be read)."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


def write_adaptive_config(log_path: Path, settings: ServerSettings) -> Path:
    """Write an adaptive server's config next to its launch log, and return its path.

    The worker's own file in its own log directory, named after the launch: the lease carries the
    steps per batch size as numbers (optimizer.sglang.AdaptiveSteps, validated on receipt), never
    a path or file text, so nothing from the API chooses what is written or where.
    """
    assert settings.adaptive is not None
    path = log_path.with_name(log_path.name.removesuffix(".log") + ".adaptive.json")
    try:
        with path.open("x", encoding="utf-8") as f:  # a new file: never follows or overwrites one
            f.write(settings.adaptive.config_text() + "\n")
    except OSError as e:
        raise ConfigError(f"cannot write the adaptive config {path}: {e}; check engine log_dir") from e
    logger.info("adaptive config %s: %s", path, settings.adaptive.config_text())
    return path


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile (another worker pruning the same directory)
        return 0.0


@dataclass
class RunningServer:
    pid: int
    pgid: int
    base_url: str
    log_path: Path
    argv: list[str]
    startup_s: float
    server_info: dict[str, Any]
    # speculative_*, attention_backend, max_running_requests, page_size, cuda_graph_max_bs(_decode), as reported
    effective: dict[str, Any]
    mismatches: dict[str, tuple[Any, Any]]  # field -> (asked, effective)
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    def log_tail(self, max_bytes: int = 8000) -> str:
        return read_tail(self.log_path, max_bytes)

    def is_alive(self) -> bool:
        if self._process is None:
            return bool(group_members(self.pgid))
        return self._process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def death(self) -> LaunchError | None:
        """None while the server runs; once it has died, the `crash` to report (cause in the message)."""
        rc = self.returncode
        if rc is None:
            return None
        tail = self.log_tail()
        _kind, _host, message = classify_exit(rc, tail)
        return LaunchError("crash", f"server died after start-up: {message}", log_tail=tail)


@dataclass
class _Child:
    process: subprocess.Popen[bytes]
    pgid: int
    log_path: Path
    stop_requested: threading.Event = field(default_factory=threading.Event)
    stopped: bool = False  # every process of its group is gone
    # Every PID seen in its group: one that dies early may still hold GPU memory in the driver.
    pids: set[int] = field(default_factory=set)
    last_scan: float = float("-inf")


class Launcher:
    """Runs one server at a time for `engine`.

    `gpu_probe` None means no GPU checks (no driver here, or the simulator); the worker passes
    `workers.gpu.open_probe()`.  Thread use: one thread launches; another may `stop()` (the launch
    then raises LaunchCancelled) or set the launch's `cancel` event.
    """

    def __init__(
        self,
        engine: EngineConfig,
        gpu_probe: GpuProbe | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._probe = gpu_probe
        self._clock = clock
        self._state_lock = threading.Lock()  # guards _child / _current
        self._stop_lock = threading.RLock()  # one stop at a time (re-entered by stop() -> _stop_child)
        self._launch_lock = threading.Lock()  # one launch at a time
        self._child: _Child | None = None
        self._current: RunningServer | None = None
        # PIDs whose GPU memory was not yet seen released; the next stop() waits for them again.
        self._unreleased: set[int] = set()
        self._no_probe_logged = False
        self._launch_seq = itertools.count(1)

    @property
    def current(self) -> RunningServer | None:
        return self._current

    # -- launch -----------------------------------------------------------------------------

    def launch(
        self,
        settings: ServerSettings,
        *,
        version: str,
        model_path: str,
        draft_model_path: str | None,
        cancel: threading.Event | None = None,
        on_phase: Callable[[str], None] | None = None,
    ) -> RunningServer:
        """Stop any previous server, start this one, and return it once `/health_generate` answers 200.

        `on_phase` hears, in order: stopping_previous, starting, waiting_for_port, warming_up (port
        open), reading_server_info, ready.  Raises LaunchError (kind: invalid_config, oom,
        launch_timeout, crash), LaunchCancelled, ConfigError (log_dir or interpreter unusable) and,
        from stopping the previous server, GpuReleaseTimeout / ProcessSurvivedError.
        """
        phase = on_phase or (lambda _p: None)
        cancel = cancel or threading.Event()
        with self._launch_lock:
            phase("stopping_previous")
            self.stop()
            log_path = self._new_log_path()
            argv = build_argv(
                self._engine,
                settings,
                version=version,
                model_path=model_path,
                draft_model_path=draft_model_path,
                adaptive_config_path=None
                if settings.adaptive is None
                else str(write_adaptive_config(log_path, settings)),
            )
            self._ensure_port_free(cancel)
            if cancel.is_set():
                raise LaunchCancelled("launch cancelled before the server was started")
            child = self._spawn(argv, log_path)
            phase("starting")
            try:
                running = self._await_ready(child, argv, settings, cancel, phase)
            except BaseException as e:
                self._cleanup_after_failure(e)
                raise
            with self._state_lock:
                self._current = running
            phase("ready")
            return running

    def _ensure_port_free(self, cancel: threading.Event) -> None:
        e = self._engine
        deadline = self._clock() + _PORT_FREE_WAIT_S
        while port_open(e.host, e.port):
            if self._clock() >= deadline or cancel.is_set():
                raise LaunchError(
                    "crash",
                    f"port {e.port} on {e.host} is already in use by another process, so the server's readiness "
                    "could not be told apart from it; stop that process or give the worker another engine port",
                    host_fault=True,
                )
            cancel.wait(0.25)

    def _new_log_path(self) -> Path:
        log_dir = self._engine.log_dir
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create the server log directory {log_dir}: {e}; set engine log_dir") from e
        for glob in (_LOG_GLOB, _ADAPTIVE_GLOB):
            old = sorted(log_dir.glob(glob), key=_mtime)
            for p in old[: max(0, len(old) - (KEEP_LOGS - 1))]:
                p.unlink(missing_ok=True)
        # Microseconds and the worker's PID: two launches (or two workers sharing log_dir) never share a file.
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        return log_dir / f"server-{stamp}-p{self._engine.port}-w{os.getpid()}-{next(self._launch_seq)}.log"

    def _spawn(self, argv: list[str], log_path: Path) -> _Child:
        logger.info("launching %s (log %s)", shlex.join(argv), log_path)
        try:
            with log_path.open("xb") as log:
                process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=server_env(self._engine),
                    start_new_session=True,  # own session and process group: the stop signals all of it
                    close_fds=True,
                )
        except OSError as e:
            raise ConfigError(f"cannot start the engine {argv[0]!r}: {e}; check engine.python") from e
        child = _Child(process=process, pgid=process.pid, log_path=log_path)
        with self._state_lock:
            self._child = child
        logger.info("server started: pid %d", process.pid)
        return child

    def _await_ready(
        self,
        child: _Child,
        argv: list[str],
        settings: ServerSettings,
        cancel: threading.Event,
        phase: Callable[[str], None],
    ) -> RunningServer:
        e = self._engine
        started = self._clock()
        with httpx.Client(trust_env=False) as client:  # never through a proxy: the server is local
            result = wait_until_ready(
                client=client,
                base_url=e.base_url,
                host=e.host,
                port=e.port,
                is_alive=lambda: self._watch(child),
                deadline=started + e.startup_timeout_s,
                cancel=cancel,
                clock=self._clock,
                on_phase=phase,
            )
            elapsed = self._clock() - started
            if result.outcome is Outcome.CANCELLED or child.stop_requested.is_set():
                self._stop_child(child)
                raise LaunchCancelled(f"launch cancelled after {elapsed:.1f} s; the server was stopped")
            if result.outcome is Outcome.DIED:
                rc = child.process.wait()
                self._stop_child(child)  # its children may outlive it; the tail is complete afterwards
                tail = read_tail(child.log_path)
                kind, host_fault, message = classify_exit(rc, tail, study_flags=settings.extra_args.keys())
                logger.warning("server died during start-up after %.1f s: %s", elapsed, message)
                raise LaunchError(kind, message, log_tail=tail, host_fault=host_fault)
            if result.outcome is Outcome.TIMEOUT:
                self._stop_child(child)
                tail = read_tail(child.log_path)
                message = (
                    f"server not ready {e.startup_timeout_s:.0f} s after launch (last seen: {result.state}); "
                    "large MoE servers can take 10-15 min to capture CUDA graphs: raise startup_timeout_s if "
                    "the log shows progress"
                )
                logger.warning("%s", message)
                raise LaunchError("launch_timeout", message, log_tail=tail)
            child.pids |= group_members(child.pgid)
            logger.info("server ready after %.1f s (%s); processes %s", elapsed, result.state, sorted(child.pids))
            phase("reading_server_info")
            info = fetch_server_info(client, e.base_url)
        effective = effective_settings(info)
        mismatches = find_mismatches(settings, effective)
        for key, (asked, got) in mismatches.items():
            logger.warning("server resolved %s differently: asked %r, runs %r", key, asked, got)
        return RunningServer(
            pid=child.process.pid,
            pgid=child.pgid,
            base_url=e.base_url,
            log_path=child.log_path,
            argv=argv,
            startup_s=elapsed,
            server_info=info,
            effective=effective,
            mismatches=mismatches,
            _process=child.process,
        )

    def _watch(self, child: _Child) -> bool:
        """Liveness for the readiness wait; also notes the group's PIDs (about once a second) so
        that ranks dying early, e.g. of an OOM, are still waited for in the driver after the stop."""
        now = self._clock()
        if now - child.last_scan >= _SCAN_EVERY_S:
            child.last_scan = now
            child.pids |= group_members(child.pgid)
        return child.process.poll() is None

    def _cleanup_after_failure(self, error: BaseException) -> None:
        try:
            self.stop()
        except WorkerError as cleanup_error:
            # The launch's own error is what the trial reports; the host problem stays recorded in
            # _unreleased / _child and is raised again by the next stop() or launch().
            logger.error("cleanup after a failed launch failed: %s", cleanup_error)
            error.add_note(f"cleanup after the failed launch also failed: {cleanup_error}")

    # -- stop -------------------------------------------------------------------------------

    def kill_now(self) -> int | None:
        """SIGKILL the process group of the running or starting server at once, without waiting.

        For a worker's second shutdown signal, when there is no time for a clean stop.  Returns
        the process group killed, or None when there was none.  Does not reap or wait for GPU
        memory: the next stop() or launch() does that.
        """
        with self._state_lock:
            child = self._child
        if child is None or child.stopped:
            return None
        try:
            os.killpg(child.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return child.pgid

    def stop(self) -> None:
        """Stop the current (or starting) server and wait until its GPU memory is free; idempotent.

        Raises ProcessSurvivedError when processes outlive SIGKILL, GpuReleaseTimeout when their
        memory is not freed in time (both also on the next call, until resolved).
        """
        with self._stop_lock:
            with self._state_lock:
                child = self._child
            if child is not None:
                self._stop_child(child)
            if self._unreleased:
                self._wait_gpu_release()

    def _stop_child(self, child: _Child) -> None:
        """Terminate the child's process group (no GPU wait); idempotent, serialised with stop()."""
        child.stop_requested.set()
        with self._stop_lock:
            if child.stopped:
                return
            logger.info("stopping server pid %d", child.process.pid)
            started = self._clock()
            pids = stop_group(child.process, child.pgid, term_timeout_s=self._engine.stop_timeout_s, clock=self._clock)
            child.stopped = True
            logger.info(
                "server pid %d stopped (%s) after %.1f s",
                child.process.pid,
                describe_returncode(child.process.returncode if child.process.returncode is not None else 0),
                self._clock() - started,
            )
            with self._state_lock:
                if self._child is child:
                    self._child = None
                    self._current = None
                self._unreleased |= pids | child.pids

    def _wait_gpu_release(self) -> None:
        if self._probe is None:
            if not self._no_probe_logged:
                logger.info(
                    "no GPU probe (no NVIDIA driver, or a simulated engine): not waiting for GPU memory release"
                )
                self._no_probe_logged = True
            self._unreleased.clear()
            return
        wait_gpu_release(
            self._probe, set(self._unreleased), timeout_s=self._engine.gpu_release_timeout_s, clock=self._clock
        )
        self._unreleased.clear()
