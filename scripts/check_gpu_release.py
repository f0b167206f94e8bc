"""Check on a GPU host that the launcher's stop really gives the GPU memory back (issue 3).

Starts scripts/gpu_standin.py through workers.launcher.Launcher (as `python -m scripts.gpu_standin`,
with this repository on PYTHONPATH), twice: once stopping gracefully on SIGTERM, once with a
stand-in that ignores SIGTERM so the launcher must SIGKILL the group.  Each round prints NVML's
used memory before launch, after launch and after stop, with timings, and fails unless

* the stand-in (parent and child) really held the memory it was asked to, as NVML shows;
* stop() returned (its NVML wait saw the PIDs gone) and left no process of the group alive;
* used memory went back to the idle level (within --tolerance-mib) before --release-timeout.

Run from the repository root on the device machine:  python scripts/check_gpu_release.py --gpu 0
Exit status: 0 all good, 1 a check failed, 2 no NVML / no GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a file (python scripts/check_gpu_release.py) without an install
    sys.path.insert(0, str(REPO))

from optimizer.sglang import ServerSettings  # noqa: E402
from workers.errors import WorkerError  # noqa: E402
from workers.gpu import NvmlProbe, open_probe  # noqa: E402
from workers.launcher import EngineConfig, Launcher  # noqa: E402
from workers.launcher.processes import group_members  # noqa: E402

_POLL_S = 0.1


def say(message: str) -> None:
    print(message, flush=True)  # noqa: T201 (this is a report for a person)


def used_mib(probe: NvmlProbe, gpu: int) -> float:
    for d in probe.devices():
        if d.index == gpu:
            return d.memory_used_mib
    raise SystemExit(f"GPU {gpu} not found by NVML")


def show_processes(probe: NvmlProbe, gpu: int, ours: set[int]) -> set[int]:
    listed = set()
    for p in probe.compute_processes():
        if p.gpu_index == gpu:
            mark = "  <- stand-in" if p.pid in ours else ""
            used = "?" if p.used_mib is None else f"{p.used_mib:.0f}"
            say(f"    NVML: GPU {gpu} pid {p.pid} uses {used} MiB{mark}")
            listed.add(p.pid)
    return listed & ours


def _launch_and_stop(
    probe: NvmlProbe, launcher: Launcher, args: argparse.Namespace, *, name: str, idle: float
) -> list[str]:
    failures: list[str] = []
    settings = ServerSettings(target="gpu-standin", max_running_requests=1)
    t0 = time.monotonic()
    try:
        server = launcher.launch(settings, version="0.5.23", model_path="gpu-standin", draft_model_path=None)
    except WorkerError as e:
        say(f"  FAIL: launch failed: {e}")
        tail = getattr(e, "log_tail", "")
        if tail:
            say("  log tail:\n" + tail)
        return [f"{name}: launch failed"]
    pids = group_members(server.pgid)
    say(
        f"  ready after {time.monotonic() - t0:.1f} s; pid {server.pid}, group pids {sorted(pids)}; log {server.log_path}"
    )
    loaded = used_mib(probe, args.gpu)
    expected = (args.gib + args.child_gib) * 1024
    say(f"  used after launch: {loaded:.0f} MiB (+{loaded - idle:.0f} MiB; asked for {expected:.0f} MiB)")
    on_gpu = show_processes(probe, args.gpu, pids)
    if loaded - idle < 0.9 * expected:
        failures.append(f"{name}: the stand-in holds only {loaded - idle:.0f} MiB of {expected:.0f} MiB")
    if len(on_gpu) < 2:
        failures.append(
            f"{name}: NVML lists {sorted(on_gpu)} of the stand-in's pids {sorted(pids)} "
            "(a PID namespace hides them? then the release wait cannot see them)"
        )
    t1 = time.monotonic()
    try:
        launcher.stop()
        say(f"  stop() returned after {time.monotonic() - t1:.2f} s (process group gone, NVML wait done)")
    except WorkerError as e:
        failures.append(f"{name}: stop failed: {e}")
        say(f"  FAIL: stop failed after {time.monotonic() - t1:.2f} s: {e}")
    survivors = group_members(server.pgid)
    if survivors:
        failures.append(f"{name}: processes {sorted(survivors)} of the group survived stop()")
    deadline = time.monotonic() + args.release_timeout
    now_used = used_mib(probe, args.gpu)
    while now_used > idle + args.tolerance_mib and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        now_used = used_mib(probe, args.gpu)
    after = time.monotonic() - t1
    say(f"  used after stop: {now_used:.0f} MiB ({now_used - idle:+.0f} MiB vs idle) at {after:.2f} s after stop()")
    if now_used > idle + args.tolerance_mib:
        failures.append(f"{name}: used memory {now_used:.0f} MiB not back to idle {idle:.0f} MiB")
    show_processes(probe, args.gpu, pids)
    return failures


def run_round(probe: NvmlProbe, args: argparse.Namespace, *, name: str, ignore_sigterm: bool) -> list[str]:
    """One launch/stop cycle; returns the failed checks (empty when all passed)."""
    failures: list[str] = []
    say(f"\n=== round {name!r}: {args.gib:g} GiB in the server + {args.child_gib:g} GiB in its child ===")
    idle = used_mib(probe, args.gpu)
    say(f"  idle used memory: {idle:.0f} MiB")
    engine = EngineConfig(
        python=sys.executable,
        module="scripts.gpu_standin",
        port=args.port,
        env={
            "PYTHONPATH": str(REPO),
            "SPECTUNE_STANDIN_GIB": str(args.gib),
            "SPECTUNE_STANDIN_CHILD_GIB": str(args.child_gib),
            "SPECTUNE_STANDIN_IGNORE_SIGTERM": "1" if ignore_sigterm else "0",
            "SPECTUNE_STANDIN_MAX_S": "900",
        },
        log_dir=args.log_dir,
        startup_timeout_s=args.startup_timeout,
        stop_timeout_s=3.0 if ignore_sigterm else 30.0,
        gpu_release_timeout_s=args.release_timeout,
        gpu_indices=(args.gpu,),
    )
    launcher = Launcher(engine, gpu_probe=probe)
    try:
        failures += _launch_and_stop(probe, launcher, args, name=name, idle=idle)
    finally:
        try:
            launcher.stop()  # a no-op after a clean round; after a failed one, nothing may be left
        except WorkerError as e:
            failures.append(f"{name}: final stop failed: {e}")
    say(f"  round {name!r}: {'OK' if not failures else 'FAILED'}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU to use")
    parser.add_argument("--gib", type=float, default=16.0, help="GiB the stand-in server allocates")
    parser.add_argument("--child-gib", type=float, default=4.0, help="GiB its child allocates")
    parser.add_argument("--port", type=int, default=31911)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--release-timeout", type=float, default=120.0)
    parser.add_argument("--tolerance-mib", type=float, default=256.0, help="slack over the idle level")
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "spectune-gpu-check")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="  %(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    spec = importlib.util.find_spec("scripts.gpu_standin")
    if spec is None or spec.origin is None or Path(spec.origin).resolve() != REPO / "scripts" / "gpu_standin.py":
        say(f"FAIL: `scripts.gpu_standin` resolves to {spec and spec.origin}, not this repository's stand-in")
        return 1
    probe = open_probe()
    if probe is None:
        say("no NVML here (no NVIDIA driver or no pynvml): nothing to check")
        return 2
    try:
        devices = probe.devices()
        say(f"driver {probe.driver_version()}; GPUs:")
        for d in devices:
            say(f"  {d.index}: {d.name}, {d.memory_total_mib:.0f} MiB, {d.memory_used_mib:.0f} MiB used")
        if not any(d.index == args.gpu for d in devices):
            say(f"GPU {args.gpu} not found")
            return 2
        failures = run_round(probe, args, name="graceful (SIGTERM)", ignore_sigterm=False)
        failures += run_round(probe, args, name="forced (SIGTERM ignored -> SIGKILL)", ignore_sigterm=True)
    finally:
        probe.close()
    say("\n=== result ===")
    for f in failures:
        say(f"FAIL {f}")
    say("all checks passed" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
