"""The worker process's wiring: config → real collaborators → `Agent`, signals, logging, exit status.

`workers/cli.py` (`spectune worker`) calls `main`; `python -m workers.main worker.toml` runs the
same on a host without the CLI.  The loop itself is `workers/agent.py`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spectune_protocol.printable import printable
from workers.agent import EXIT_CONFIG, Agent, AgentSettings
from workers.client import ApiClient, Backoff, make_http_client
from workers.config import WorkerConfig, load_config, read_token
from workers.errors import ConfigError
from workers.gpu import GpuProbe, open_probe
from workers.inventory import build_inventory, config_digest, gpu_inventory, prompt_files
from workers.lifeline import exit_with_parent
from workers.outbox import Outbox
from workers.preflight import check_engine_imports, check_gpus, check_prompt_dir
from workers.shutdown import ShutdownSignals

if TYPE_CHECKING:
    from workers.launcher import EngineConfig

log = logging.getLogger("spectune.worker.agent")


class OneLineMessages(logging.Filter):
    """Every message one line, with no terminal controls: what the API sends (a study name, a
    message) cannot forge a log line or rewrite the reader's terminal.  Tracebacks, formatted
    from `exc_info` after this, keep their lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        safe = printable(message)
        if safe != message:
            record.msg, record.args = safe, None
        return True


def _configure_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:  # the CLI may have configured logging already
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat is noise
    for handler in root.handlers:
        if not any(isinstance(f, OneLineMessages) for f in handler.filters):
            handler.addFilter(OneLineMessages())


def _force_exit(agent: Agent, signum: int) -> None:
    log.error("second signal (%s): killing the server and exiting now", signal.Signals(signum).name)
    agent.force_stop()
    logging.shutdown()
    os._exit(128 + signum)


def engine_config(cfg: WorkerConfig) -> EngineConfig:
    """How this worker runs its engine, from its validated config (the agent's and `spectune doctor`'s)."""
    from workers.launcher import EngineConfig

    return EngineConfig(
        python=str(cfg.engine.python),
        module=cfg.engine.module,
        host=cfg.engine.host,
        port=cfg.engine.port,
        env=dict(cfg.engine.env),
        log_dir=cfg.engine.log_dir,
        startup_timeout_s=cfg.timeouts.startup_s,
        stop_timeout_s=cfg.timeouts.stop_s,
        gpu_release_timeout_s=cfg.timeouts.gpu_release_s,
        gpu_indices=None if cfg.gpus is None else tuple(cfg.gpus),
        sglang_version=cfg.engine.sglang_version,
    )


def build_agent(cfg: WorkerConfig, *, stop_event: threading.Event, http: Any, probe: GpuProbe | None = None) -> Agent:
    """Wire the real collaborators from a validated config; `probe` is NVML's (None: no GPU checks)."""
    from workers.launcher import Launcher, detect_sglang_version
    from workers.launcher.config import server_env

    engine = engine_config(cfg)
    # Before any lease: a worker that cannot run its engine refuses to start (workers/preflight.py).
    check_engine_imports(engine.python, engine.module, env=server_env(engine))
    check_gpus(probe, cfg.gpus, cfg.labels)
    check_prompt_dir(cfg.prompt_dir)
    version = detect_sglang_version(engine.python, cfg.engine.sglang_version, env=server_env(engine))
    files = prompt_files(cfg.prompt_dir)
    digest = config_digest(
        allowed_extra_args=cfg.engine.allowed_extra_args,
        models=cfg.models,
        prompt_dir=cfg.prompt_dir,
        files=files,
        sglang_version=version,
        engine_python=engine.python,
        engine_module=engine.module,
        gpus=gpu_inventory(probe, cfg.gpus)[0],
    )
    inventory = build_inventory(
        sglang_version=version,
        models=list(cfg.models),
        labels=cfg.labels,
        probe=probe,
        gpus=cfg.gpus,
        digest=digest,
        files=files,
    )
    client = ApiClient(
        http,
        token=read_token(cfg),
        worker_id=cfg.worker_id,
        backoff=Backoff(max_s=cfg.timeouts.api_retry_max_s),
        retry_for_s=cfg.timeouts.api_retry_max_s,
        wait=stop_event.wait,
    )
    settings = AgentSettings(
        models=cfg.models,
        prompt_dir=cfg.prompt_dir,
        sglang_version=version,
        request_timeout_s=cfg.timeouts.request_s,
        heartbeat_max_s=cfg.timeouts.heartbeat_s,
        idle_poll_s=cfg.idle_poll_s,
        idle_poll_max_s=cfg.idle_poll_max_s,
        api_retry_max_s=cfg.timeouts.api_retry_max_s,
        allowed_extra_args=frozenset(cfg.engine.allowed_extra_args),
    )
    return Agent(
        client=client,
        outbox=Outbox(cfg.outbox_dir),
        launcher=Launcher(engine, gpu_probe=probe),
        inventory=inventory,
        settings=settings,
        stop_event=stop_event,
    )


def main(config_path: Path) -> int:
    """`spectune worker --config PATH`: run the agent until SIGTERM.  Returns the exit status."""
    _configure_logging()
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        log.error("%s", e)
        return EXIT_CONFIG
    log.info("worker %s: API %s, outbox %s", cfg.worker_id, cfg.api_url, cfg.outbox_dir)
    stop_event = threading.Event()
    probe = open_probe()
    try:
        with make_http_client(cfg.api_url, timeout_s=cfg.timeouts.api_s) as http:
            try:
                agent = build_agent(cfg, stop_event=stop_event, http=http, probe=probe)
            except ConfigError as e:
                log.error("%s", e)
                return EXIT_CONFIG
            with ShutdownSignals(
                first=lambda signum: agent.request_stop(f"{signal.Signals(signum).name} received"),
                second=lambda signum: _force_exit(agent, signum),
            ):
                return agent.run()
    finally:
        if probe is not None:
            probe.close()


if __name__ == "__main__":  # `python -m workers.main worker.toml`, for hosts without the CLI
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m workers.main /path/to/worker.toml\n")
        sys.exit(EXIT_CONFIG)
    exit_with_parent()
    sys.exit(main(Path(sys.argv[1])))
