"""The worker agent: lease → launch SGLang → benchmark → report → next (`spectune worker`).

One turn of the loop (rq-style: small steps, errors logged and never fatal to the loop):

1. deliver the reports still in the outbox; while one cannot be delivered, take no new work (the
   API would hand the same lease back and the measurement would be repeated for nothing);
2. ask for a lease with this host's inventory; 204 → wait (capped exponential back-off);
3. resolve the lease's model names through the local registry (never paths from the API) and its
   prompt set, then launch the server while a background thread heartbeats;
4. run the workload level by level, posting progress after each and stopping on `prune`;
5. write the report to the outbox, deliver it, then stop the server (every lease gets a fresh
   server: a restart is what a trial costs anyway, and nothing stale can leak into the next one).

A lost lease (409/410 from a heartbeat or progress call) cancels the work at once: the server is
stopped and nothing is reported.  A lease whose work ended here (reported, lost or abandoned), or
that was started `max_starts_per_lease` times, is never launched again: offered again, it is
refused and reported as `lost` (workers/ledger.py), so no API bug can make this host relaunch a
server in a loop.  Shutdown is two-stage (workers/shutdown.py): the first SIGTERM or
SIGINT takes no more work, cancels the launch or benchmark, stops the server, reports the lease
as failed `lost` ("worker shutting down") and exits 0; a second one kills the server's process
group and exits at once with 128 + the signal number.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from optimizer.sglang import ServerSettings, adaptive_refusal
from optimizer.spec import Workload
from optimizer.verify_probe import ProbePlan, probe_levels
from spectune_protocol import (
    CompleteIn,
    Failure,
    FailureKind,
    Inventory,
    LeaseOut,
    LevelMetrics,
    Metrics,
    ProgressIn,
    SpecField,
    VerifyProbe,
    WorkerStanding,
)
from workers import standing
from workers.client import (
    ApiClient,
    ApiError,
    ApiUnavailable,
    AuthError,
    Backoff,
    LeaseLost,
    LeaseUnreadable,
)
from workers.config import DEFAULT_ALLOWED_EXTRA_ARGS
from workers.errors import ConfigError, LaunchCancelled, LaunchError, WorkerError
from workers.heartbeat import Heartbeat
from workers.inventory import describe
from workers.launcher.processes import group_members
from workers.ledger import LaunchLedger
from workers.loadgen import LoadgenCancelled, LoadgenError, run_workload
from workers.loadgen.plan import RequestPlan, load_requests
from workers.loadgen.probe import run_verify_probe
from workers.loadgen.rejection import rejected_field
from workers.outbox import Outbox, deliver_pending
from workers.redact import redact_report
from workers.resolve import resolve

log = logging.getLogger("spectune.worker.agent")

EXIT_OK = 0
EXIT_CONFIG = 2  # bad config or token: systemd must not restart-loop on it (RestartPreventExitStatus)

_MAX_MESSAGE = 4000  # spectune_protocol.Failure.message
_MAX_LOG_TAIL = 20_000
# A word-valued server flag: never empty, never an option itself, no spaces, quotes or paths.
_SAFE_WORD_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:+-]{0,63}\Z")


class Server(Protocol):
    """What the agent uses of workers.launcher.RunningServer."""

    pgid: int
    base_url: str
    startup_s: float

    @property
    def effective(self) -> Mapping[str, Any]: ...

    @property
    def mismatches(self) -> Any: ...

    def log_tail(self) -> str: ...

    def is_alive(self) -> bool: ...


class ServerLauncher(Protocol):
    """What the agent uses of workers.launcher.Launcher."""

    @property
    def current(self) -> Server | None: ...

    def launch(
        self,
        settings: ServerSettings,
        *,
        version: str,
        model_path: str,
        draft_model_path: str | None,
        cancel: threading.Event | None,
        on_phase: Callable[[str], None] | None = None,
    ) -> Server: ...

    def stop(self) -> None: ...

    def kill_now(self) -> int | None: ...


RunWorkload = Callable[..., list[LevelMetrics]]
RunProbe = Callable[..., VerifyProbe]
LoadRequests = Callable[[Workload, Path | None], RequestPlan]


@dataclass(frozen=True)
class AgentSettings:
    """The parts of WorkerConfig the loop needs, as plain values (tests build them directly)."""

    models: Mapping[str, Path]
    prompt_dir: Path | None
    sglang_version: str
    request_timeout_s: float = 600.0
    heartbeat_max_s: float | None = None
    idle_poll_s: float = 5.0
    idle_poll_max_s: float = 60.0
    api_retry_max_s: float = 60.0
    # Extra server flags a lease may carry (WorkerConfig.engine.allowed_extra_args).
    allowed_extra_args: frozenset[str] = frozenset(DEFAULT_ALLOWED_EXTRA_ARGS)
    # The verify probe after a baseline's benchmark (workers/loadgen/probe.py): its wall-time
    # budget; 0 runs none.
    verify_probe_budget_s: float = 120.0


def _failed(
    kind: FailureKind,
    message: str,
    *,
    log_tail: str = "",
    host_fault: bool = False,
    spec_field: SpecField | None = None,
) -> CompleteIn:
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 3] + "..."
    failure = Failure(
        kind=kind, message=message, log_tail=log_tail[-_MAX_LOG_TAIL:], host_fault=host_fault, spec_field=spec_field
    )
    return CompleteIn(outcome="failed", failure=failure)


def server_settings_refusal(settings: ServerSettings, allowed_extra_args: frozenset[str]) -> str | None:
    """Why this worker will not launch these settings, or None.

    The worker does not trust the API (SECURITY.md): a study's extra flags were checked against
    the API's allowlist, but only this host's own list decides what it runs.  Values become
    single argv elements (never a shell), and a word value that looked like an option would let
    argparse read it as a flag, so such values are refused too.  The adaptive flags are the
    worker's own (workers.config.RESERVED_FLAGS): a lease sets them only as typed steps.
    """
    refused = sorted(flag for flag in settings.extra_args if flag not in allowed_extra_args)
    if refused:
        allowed = ", ".join(sorted(allowed_extra_args)) or "none"
        return (
            f"server flag(s) {', '.join(refused)} not on this worker's allowlist (allowed: {allowed}); "
            "add them to engine.allowed_extra_args in the worker config if this host should accept them, "
            "or remove them from the study's model.extra_args"
        )
    for flag, value in sorted(settings.extra_args.items()):
        if isinstance(value, str) and not _SAFE_WORD_RE.match(value):
            return f"server flag {flag} has the value {value[:80]!r}; only a short word (letters, digits, . _ : + -) is accepted"
    if not _SAFE_WORD_RE.match(settings.attention_backend):
        return f"attention backend {settings.attention_backend[:80]!r} is not a backend name"
    return None


def describe_lease(lease: LeaseOut) -> str:
    s = lease.server
    if s.speculative is None:
        what = "no speculation"
    else:
        c = s.speculative.canonical()
        what = f"EAGLE-3 steps={c.num_steps} topk={c.topk} draft_tokens={c.num_draft_tokens}"
        if s.adaptive is not None:
            what += f" adaptive {s.adaptive.config_text()}"
    trial = "" if lease.trial_number is None else f" trial {lease.trial_number}"
    return (
        f"{lease.kind} for study {lease.study}{trial} (attempt {lease.attempt}): {s.target} tp={s.tp_size} "
        f"{s.attention_backend}, {what}, concurrency {lease.workload.concurrency}"
    )


class _LeaseRun:
    """State of one lease while it runs (so callbacks from other threads can see it)."""

    def __init__(self, lease: LeaseOut, cancel: threading.Event) -> None:
        self.lease = lease
        self.cancel = cancel
        self.lost = threading.Event()
        self.pruned = False
        self.levels: list[LevelMetrics] = []  # measured so far


class Agent:
    """The loop.  Every collaborator is injected; `main()` wires the real ones."""

    def __init__(
        self,
        *,
        client: ApiClient,
        outbox: Outbox,
        launcher: ServerLauncher,
        inventory: Inventory,
        settings: AgentSettings,
        run_workload: RunWorkload = run_workload,
        load_requests: LoadRequests = load_requests,
        run_probe: RunProbe = run_verify_probe,
        stop_event: threading.Event | None = None,
        backoff: Backoff | None = None,
        ledger: LaunchLedger | None = None,
    ) -> None:
        self.client = client
        self.outbox = outbox
        self.launcher = launcher
        self.inventory = inventory
        self.settings = settings
        self._run_workload = run_workload
        self._load_requests = load_requests
        self._run_probe = run_probe
        self.stop_event = stop_event or threading.Event()
        self._idle = backoff or Backoff(initial_s=settings.idle_poll_s, max_s=settings.idle_poll_max_s)
        self._idle_attempt = 0
        self._current: _LeaseRun | None = None
        self._lock = threading.Lock()
        self.leases_done = 0
        self.leases_refused = 0
        self._standing = WorkerStanding()  # nothing decided yet: a first quarantine is news
        self.ledger = ledger if ledger is not None else LaunchLedger(outbox.root)

    # -- shutdown (called from the signal watcher thread, never from a signal handler) ----------

    def request_stop(self, reason: str = "stop requested") -> None:
        """First stage: take no more work and abandon the current lease (it is reported as lost)."""
        log.warning("%s: taking no more work; abandoning the current lease, if any", reason)
        with self._lock:
            self.stop_event.set()
            if self._current is not None:
                self._current.cancel.set()

    def force_stop(self) -> None:
        """Second stage: kill the server's whole process group now.  The caller then exits."""
        try:
            pgid = self.launcher.kill_now()
        except OSError as e:
            log.error("could not kill the server's process group: %s", e)
            return
        if pgid is not None:
            log.error("killed the server's process group %d", pgid)

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Work until a stop is requested (exit 0) or the API refuses the token (EXIT_CONFIG)."""
        log.info("worker started: %s", describe(self.inventory))
        try:
            while not self.stop_event.is_set():
                try:
                    self.run_once()
                except AuthError:
                    raise
                except Exception:  # e.g. the outbox folder vanished: log, wait, try again
                    log.exception("worker loop error; continuing")
                    self._wait_idle("loop error")
        except AuthError as e:
            log.error("%s; the worker cannot work without a valid token and exits", e)
            return EXIT_CONFIG
        finally:
            self._stop_server()
            if len(self.outbox):
                log.warning(
                    "%d report(s) remain in the outbox %s for the next start", len(self.outbox), self.outbox.root
                )
        log.info("worker stopped after %d lease(s)", self.leases_done)
        return EXIT_OK

    def run_once(self) -> None:
        """One turn: outbox, lease, work, report.  Raises only AuthError."""
        if not deliver_pending(self.outbox, self.client):
            self._wait_idle("the outbox could not be delivered; no new work until it is")
            return
        if self.stop_event.is_set():
            return
        try:
            lease = self.client.lease(self.inventory)
        except AuthError:
            raise
        except ApiUnavailable as e:
            self._wait_idle(str(e))
            return
        except LeaseUnreadable as e:
            # Off protocol (e.g. a value this worker cannot take): a study fault, refused by id so
            # the API ends the lease instead of handing it back until it expires.
            log.error("lease %s cannot be read and is REFUSED: %s", e.lease_id, e)
            self._report(e.lease_id, _failed("refused", f"the lease does not match this worker's protocol: {e}"))
            self._wait_idle("an unreadable lease was refused")
            return
        except ApiError as e:
            log.error("asking for work failed: %s", e)
            self._wait_idle("lease request refused")
            return
        self._note_standing(self.client.standing)
        if lease is None:
            self._wait_idle(None)
            return
        self._idle_attempt = 0
        try:
            self.process_lease(lease)
        except AuthError:
            raise
        except Exception:  # the loop must survive anything one lease does
            log.exception("lease %s: unexpected worker error", lease.lease_id)
            self._wait_idle("unexpected error")

    def _note_standing(self, now: WorkerStanding | None) -> None:
        """Log, once per change, what the fleet decided about this host (workers/standing.py)."""
        if now is None:  # an API that does not say: nothing to compare
            return
        for level, text in standing.changes(self._standing, now, self.client.worker_id):
            log.log(level, "%s", text)
        self._standing = now

    def _wait_idle(self, why: str | None) -> None:
        delay = self._idle.delay(self._idle_attempt)
        self._idle_attempt += 1
        if why is None:
            log.debug("no work; asking again in %.1f s", delay)
        else:
            log.info("%s; trying again in %.1f s", why, delay)
        self.stop_event.wait(delay)

    # -- one lease ----------------------------------------------------------------------------

    def process_lease(self, lease: LeaseOut) -> None:
        log.info("lease %s: %s", lease.lease_id, describe_lease(lease))
        refusal = self.ledger.refusal(lease.lease_id)
        if refusal is not None:
            # Never relaunch: report it so the API ends the lease, and wait before asking again.
            log.error("lease %s offered again and REFUSED: %s", lease.lease_id, refusal)
            self.leases_refused += 1
            self._report(lease.lease_id, _failed("lost", f"refused by the worker: {refusal}"))
            self._wait_idle("a lease this worker must not start again was offered")
            return
        self.ledger.started(lease.lease_id)
        run = _LeaseRun(lease, threading.Event())
        with self._lock:
            self._current = run
            if self.stop_event.is_set():
                run.cancel.set()
        interval = lease.heartbeat_interval_s
        if self.settings.heartbeat_max_s is not None:
            interval = min(interval, self.settings.heartbeat_max_s)
        heartbeat = Heartbeat(self.client, lease.lease_id, max(interval, 0.05), cancel=run.cancel)
        try:
            with heartbeat:
                report = self._work(run, heartbeat)
                if run.lost.is_set() or heartbeat.lost.is_set():
                    log.warning("lease %s was lost; its work is abandoned and not reported", lease.lease_id)
                elif report is not None:
                    self._report(lease.lease_id, report)
        finally:
            self.ledger.ended(lease.lease_id)
            with self._lock:
                self._current = None
            self._stop_server()
            self.leases_done += 1

    def _abandoned(self, run: _LeaseRun, heartbeat: Heartbeat) -> CompleteIn | None:
        if run.lost.is_set() or heartbeat.lost.is_set():
            return None
        message = "worker shutting down" if self.stop_event.is_set() else "worker cancelled the lease"
        report = _failed("lost", message)
        if run.levels:
            assert report.failure is not None
            report.failure.levels = list(run.levels)
        return report

    def _work(self, run: _LeaseRun, heartbeat: Heartbeat) -> CompleteIn | None:
        lease = run.lease
        settings = lease.server
        lid = lease.lease_id
        missing = [m for m in (settings.target, settings.draft) if m is not None and m not in self.settings.models]
        if missing:
            known = ", ".join(sorted(self.settings.models)) or "none"
            return _failed(
                "refused",
                f"model(s) {', '.join(missing)} not in this worker's model registry (known: {known}); "
                "add them to [models] in the worker config, or place the study on workers that have them",
            )
        refusal = server_settings_refusal(settings, self.settings.allowed_extra_args)
        if refusal is not None:
            log.warning("lease %s refused: %s", lid, refusal)
            return _failed("refused", refusal)
        if settings.adaptive is not None:
            unsupported = adaptive_refusal(self.settings.sglang_version, settings.adaptive)
            if unsupported is not None:
                # What SGLang here would reject at start-up, reported as its launch would be (not a
                # refusal of the study: the study's other work still runs here, and its answer
                # falls back to what was proven).
                log.warning("lease %s: %s", lid, unsupported)
                return _failed("invalid_config", unsupported)
        try:
            plan = self._load_requests(lease.workload, self.settings.prompt_dir)
        except (ValueError, OSError, LoadgenError) as e:
            return _failed("refused", f"prompt set {lease.workload.prompts!r}: {e}")
        if run.cancel.is_set():
            return self._abandoned(run, heartbeat)

        draft = self.settings.models[settings.draft] if settings.draft is not None else None
        self._stop_server()  # a server left over from an earlier lease (normally none)
        log.info("lease %s: launching the server", lid)
        try:
            server = self.launcher.launch(
                settings,
                version=self.settings.sglang_version,
                model_path=str(self.settings.models[settings.target]),
                draft_model_path=None if draft is None else str(draft),
                cancel=run.cancel,
                on_phase=lambda phase: log.info("lease %s: server %s", lid, phase),
            )
        except LaunchCancelled:
            log.info("lease %s: launch cancelled", lid)
            return self._abandoned(run, heartbeat)
        except LaunchError as e:
            if run.cancel.is_set():
                return self._abandoned(run, heartbeat)
            log.warning("lease %s: launch failed: %s", lid, e)
            return CompleteIn(outcome="failed", failure=e.to_failure())
        except (ConfigError, WorkerError) as e:
            log.error("lease %s: the worker cannot launch servers: %s", lid, e)
            return _failed("crash", f"worker could not launch the server: {e}", host_fault=True)
        log.info("lease %s: server ready after %.1f s at %s", lid, server.startup_s, server.base_url)
        if server.mismatches:
            log.warning("lease %s: SGLang runs other settings than requested: %s", lid, server.mismatches)
        if settings.adaptive is not None and "speculative_adaptive" in server.mismatches:
            # SGLang fell back to static speculation: measuring it would prove another command.
            return _failed(
                "invalid_config",
                "SGLang switched --speculative-adaptive off at start-up (it runs static speculation where adaptive "
                "mode is unsupported, e.g. with attention data parallelism): the adaptive deployment did not run",
                log_tail=server.log_tail(),
            )
        if run.cancel.is_set():
            return self._abandoned(run, heartbeat)

        try:
            levels = self._run_workload(
                server.base_url,
                lease.workload,
                plan.prompts,
                output_lens=plan.output_lens,
                cancel=run.cancel,
                on_level=lambda i, m: self._on_level(run, i, m),
                request_timeout_s=self.settings.request_timeout_s,
                # The host check: did the engine wait for a CPU (workers/loadgen/saturation.py)?
                engine_pids=lambda: sorted(group_members(server.pgid)),
                slo=lease.slo,
            )
        except LoadgenCancelled:
            log.info("lease %s: benchmark cancelled", lid)
            return self._abandoned(run, heartbeat)
        except LoadgenError as e:
            if run.cancel.is_set():
                return self._abandoned(run, heartbeat)
            tail = server.log_tail()
            if not server.is_alive():
                log.warning("lease %s: the server died during the benchmark: %s", lid, e)
                return _failed("crash", f"server exited during the benchmark: {e}", log_tail=tail)
            field = rejected_field(e)
            if field is not None:
                # The engine refused the study's own requests: the study's fault, naming its field.
                log.warning("lease %s: the engine rejected the study's requests (%s): %s", lid, field, e)
                return _failed("request_rejected", f"{field}: {e}", log_tail=tail, spec_field=field)
            log.warning("lease %s: benchmark failed: %s", lid, e)
            return _failed("benchmark_error", str(e), log_tail=tail)
        if run.lost.is_set():
            return None
        if run.cancel.is_set() and not levels:
            return self._abandoned(run, heartbeat)
        if not levels:
            return _failed("benchmark_error", "the benchmark measured no concurrency level", log_tail=server.log_tail())
        extra, note = 0, None
        complete = len(levels) == len(lease.workload.concurrency)
        if lease.resolve is not None and not run.cancel.is_set() and complete:
            levels, extra, note = self._resolve(run, server, lease, levels, plan)
        probe = None
        if lease.kind == "baseline" and settings.speculative is None and not run.cancel.is_set() and complete:
            probe = self._verify_probe(run, server, lease)
        metrics = Metrics(
            levels=levels,
            startup_s=server.startup_s,
            effective=dict(server.effective),
            sglang_version=self.settings.sglang_version,
            log_tail=server.log_tail(),
            extra_passes=extra,
            extra_passes_note=note,
            verify_probe=probe,
        )
        if run.cancel.is_set() and not run.pruned:
            # Shutdown between the last level and here: the levels are complete measurements, but
            # a partial workload must not pose as a finished trial.
            if len(levels) < len(lease.workload.concurrency):
                return self._abandoned(run, heartbeat)
        return CompleteIn(outcome="ok", metrics=metrics)

    def _resolve(
        self, run: _LeaseRun, server: Server, lease: LeaseOut, levels: list[LevelMetrics], plan: RequestPlan
    ) -> tuple[list[LevelMetrics], int, str | None]:
        """More passes on this warm server while the confirmation is undecided (workers/resolve.py)."""
        assert lease.resolve is not None

        def measure(concurrency: list[int], passes: int) -> list[LevelMetrics]:
            workload = lease.workload.model_copy(
                update={"concurrency": concurrency, "warmup_requests": 0, "repeats": passes}
            )
            return self._run_workload(
                server.base_url,
                workload,
                plan.prompts,
                output_lens=plan.output_lens,
                cancel=run.cancel,
                request_timeout_s=self.settings.request_timeout_s,
                engine_pids=lambda: sorted(group_members(server.pgid)),
            )

        try:
            out, extra, note = resolve(lease.resolve, levels, lease.workload.repeats, measure)
        except (LoadgenError, LoadgenCancelled) as e:
            # The levels measured before stand; only the extra passes are lost.
            log.warning("lease %s: extra passes stopped: %s", lease.lease_id, e)
            return levels, 0, f"extra passes stopped: {e}"[:500]
        log.info("lease %s: %d extra passes per level (%s)", lease.lease_id, extra, note)
        return out, extra, note

    def _verify_probe(self, run: _LeaseRun, server: Server, lease: LeaseOut) -> VerifyProbe | None:
        """Time the target's forward over verify-sized token counts on this warm baseline server
        (workers/loadgen/probe.py).  The baseline's levels stand whatever happens here: a probe
        that fails or is cancelled is reported without it (or with the points it measured)."""
        budget = self.settings.verify_probe_budget_s
        if budget <= 0:
            return None
        w = lease.workload
        plan = ProbePlan(
            levels=probe_levels(w.concurrency, lease.server.max_running_requests),
            budget_s=budget,
            request_timeout_s=min(self.settings.request_timeout_s, budget),
        )
        try:
            probe = self._run_probe(server.base_url, plan, cancel=run.cancel)
        except (LoadgenError, OSError) as e:  # LoadgenCancelled and ProbeRefused included
            log.warning("lease %s: no verify probe: %s", lease.lease_id, e)
            return None
        log.info(
            "lease %s: verify probe: %d points in %.1f s (prefix cached in %s of requests)%s",
            lease.lease_id,
            len(probe.points),
            probe.spent_s,
            "-" if probe.cached_share is None else f"{probe.cached_share:.0%}",
            "" if probe.note is None else f"; {probe.note}",
        )
        return probe

    def _on_level(self, run: _LeaseRun, index: int, m: LevelMetrics) -> bool:
        lid = run.lease.lease_id
        log.info(
            "lease %s: concurrency %d: %.1f output tok/s (runs %s), accept length %s, ITL p99 %s ms",
            lid,
            m.concurrency,
            m.output_tok_s,
            ", ".join(f"{v:.1f}" for v in m.output_tok_s_runs) or "-",
            "-" if m.accept_length is None else f"{m.accept_length:.2f}",
            "-" if m.itl_ms_p99 is None else f"{m.itl_ms_p99:.1f}",
        )
        run.levels.append(m)
        if run.cancel.is_set():
            return False
        body = ProgressIn(
            step=index,
            concurrency=m.concurrency,
            output_tok_s=m.output_tok_s,
            accept_length=m.accept_length,
            phase=run.lease.kind,
        )
        try:
            answer = self.client.progress(lid, body, retry_for_s=self.settings.api_retry_max_s / 4)
        except LeaseLost as e:
            log.error("lease %s lost: %s; abandoning its work", lid, e)
            run.lost.set()
            run.cancel.set()
            return False
        except ApiError as e:  # progress is advisory: measuring on is better than stopping
            log.warning("lease %s: progress not delivered: %s", lid, e)
            return True
        if answer.action == "prune":
            log.info("lease %s: the API pruned the trial after concurrency %d", lid, m.concurrency)
            run.pruned = True
            return False
        return True

    def _report(self, lease_id: str, report: CompleteIn) -> None:
        report = redact_report(report, self.settings.models)  # no host paths leave the host
        what = report.outcome if report.failure is None else f"failed ({report.failure.kind})"
        try:
            path = self.outbox.put(lease_id, report)
        except OSError as e:
            # Disk full or gone: still try to deliver directly rather than lose the measurement.
            log.error("lease %s: cannot write the report to the outbox (%s); sending it directly", lease_id, e)
            try:
                self.client.complete(lease_id, report)
                log.info("lease %s: report (%s) sent", lease_id, what)
            except AuthError:
                raise
            except ApiError as e2:
                log.error("lease %s: report (%s) LOST: %s", lease_id, what, e2)
            return
        log.info("lease %s: report (%s) queued in %s", lease_id, what, path)
        deliver_pending(self.outbox, self.client)

    def _stop_server(self) -> None:
        # Launcher.stop() is idempotent and also covers a server still starting up.
        try:
            self.launcher.stop()
        except WorkerError as e:
            log.error("stopping the server: %s", e)
        except Exception:
            log.exception("stopping the server failed")
