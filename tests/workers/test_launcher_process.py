"""The launcher against real processes: the simulated engine (`python -m spectune_sim`) at a fast
time scale, plus small Python processes for the process-group edge cases (issue 3).

Failure kinds are produced by the simulator as SGLang would produce them (argparse exit 2, an OOM
at start-up, a server that never gets ready, a crash after readiness) and must be classified
from exit status and log tail alone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from tests.support.helpers import free_port, wait_for
from workers.errors import GpuReleaseTimeout, LaunchCancelled, LaunchError
from workers.gpu import GpuDevice, GpuProcess
from workers.launcher import EngineConfig, Launcher, RunningServer, classify_exit
from workers.launcher.gpu_release import wait_gpu_release
from workers.launcher.processes import alive, descendants, group_members, stop_group
from workers.launcher.server_info import effective_settings, find_mismatches

DEADLINE_S = 30.0  # bound on every wait in these tests; none is expected to come near it


# --- classification, from real SGLang-style output ---------------------------------------------


def test_argparse_rejection_is_a_host_fault() -> None:
    tail = (
        "usage: launch_server.py [-h] --model-path MODEL_PATH ...\n"
        "launch_server.py: error: ambiguous option: --cuda-graph-max-bs could match "
        "--cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill\n"
    )
    kind, host_fault, message = classify_exit(2, tail)
    assert (kind, host_fault) == ("invalid_config", True)
    assert "ambiguous option: --cuda-graph-max-bs" in message
    kind, host_fault, _ = classify_exit(2, "x.py: error: unrecognized arguments: --cuda-graph-max-bs-decode 8\n")
    assert (kind, host_fault) == ("invalid_config", True)


def test_oom_wins_over_the_exception_that_carries_it() -> None:
    tail = (
        "Traceback (most recent call last):\n"
        '  File "model_runner.py", line 10, in capture\n'
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
        "ValueError: capture failed\n"
    )
    kind, host_fault, message = classify_exit(1, tail)
    assert (kind, host_fault) == ("oom", False)
    assert "CUDA out of memory" in message


def test_startup_value_error_is_the_configurations_fault() -> None:
    tail = "Scheduler hit an exception\nValueError: topk > 1 with page_size > 1 needs flashinfer, fa3 or triton\n"
    kind, host_fault, message = classify_exit(1, tail)
    assert (kind, host_fault) == ("invalid_config", False)
    assert "page_size" in message
    assert classify_exit(1, "AssertionError\n")[:2] == ("invalid_config", False)


def test_other_deaths_are_crashes_that_say_how() -> None:
    kind, host_fault, message = classify_exit(-9, "loading weights\n")
    assert (kind, host_fault) == ("crash", False)
    assert "signal SIGKILL" in message
    assert "128+SIGKILL" in classify_exit(137, "")[2]
    assert "RuntimeError: NCCL timeout" in classify_exit(1, "RuntimeError: NCCL timeout\n")[2]
    # Exit 2 without argparse's words is not a flag problem.
    assert classify_exit(2, "something odd\n")[:2] == ("crash", False)


# --- effective settings -----------------------------------------------------------------------


def test_effective_settings_and_mismatches_from_server_info() -> None:
    info = {
        "attention_backend": "fa3",
        "max_running_requests": 16,
        "page_size": 1,
        "speculative_algorithm": "EAGLE3",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
        "cuda_graph_max_bs_decode": 8,
        "internal_states": [{"effective_max_running_requests_per_dp": 16, "avg_spec_accept_length": 2.1}],
    }
    eff = effective_settings(info)
    assert eff["speculative_num_draft_tokens"] == 4
    assert eff["effective_max_running_requests_per_dp"] == 16
    assert "avg_spec_accept_length" not in eff
    asked = ServerSettings(
        target="t",
        max_running_requests=16,
        cuda_graph_max_bs=16,
        speculative=SpecConfig(num_steps=3, topk=1, num_draft_tokens=8),
    )
    assert find_mismatches(asked, eff) == {"speculative_num_draft_tokens": (8, 4), "cuda_graph_max_bs": (16, 8)}
    # Fields the server did not report are unknown, not mismatches.
    assert find_mismatches(asked, {}) == {}


# --- GPU release wait (NVML stands behind a probe) --------------------------------------------


class ScriptedProbe:
    """A GPU probe whose compute-process list is scripted per poll (the last list repeats)."""

    def __init__(self, polls: list[list[GpuProcess]]) -> None:
        self.polls = polls
        self.calls = 0

    def devices(self) -> list[GpuDevice]:
        return [GpuDevice(0, "NVIDIA H200", "GPU-0", 143771.0, 0.0)]

    def compute_processes(self) -> list[GpuProcess]:
        self.calls += 1
        return self.polls[min(self.calls - 1, len(self.polls) - 1)]

    def driver_version(self) -> str | None:
        return "580.0"


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_release_wait_returns_once_the_pids_are_gone() -> None:
    held = [GpuProcess(0, 4242, 20480.0), GpuProcess(1, 4243, 512.0), GpuProcess(0, 99, 100.0)]
    probe = ScriptedProbe([held, held, [GpuProcess(0, 99, 100.0)]])  # pid 99 belongs to someone else
    t = FakeTime()
    waited = wait_gpu_release(probe, {4242, 4243}, timeout_s=10, clock=t.clock, sleep=t.sleep)
    assert waited == pytest.approx(1.0)  # two 0.5 s polls
    assert probe.calls == 3


def test_release_wait_times_out_naming_pids_and_memory() -> None:
    probe = ScriptedProbe([[GpuProcess(0, 4242, 20480.0), GpuProcess(1, 4242, 1024.0), GpuProcess(0, 4243, None)]])
    t = FakeTime()
    with pytest.raises(GpuReleaseTimeout) as info:
        wait_gpu_release(probe, {4242, 4243}, timeout_s=3, clock=t.clock, sleep=t.sleep)
    text = str(info.value)
    assert "pid 4242: 21504 MiB" in text and "pid 4243: unknown MiB" in text and "GPU(s) 0, 1" in text
    assert info.value.held_mib == {4242: 21504.0, 4243: None}
    assert t.now >= 3


# --- process groups with plain Python processes -----------------------------------------------

# Spawns a grandchild in the group and one that escapes into its own session, then waits.
_FAMILY = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    if sys.argv[1] == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    subprocess.Popen(sleeper)
    subprocess.Popen(sleeper, start_new_session=True)
    print("family up", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("mode", ["obey", "ignore"])
def test_stop_group_leaves_nothing_alive(mode: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _FAMILY, mode], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "family up"
        family = {proc.pid} | descendants([proc.pid])
        assert len(family) == 3
        assert group_members(proc.pid) < family  # the escaped one is not in the group
        seen = stop_group(proc, proc.pid, term_timeout_s=0.5)
        assert family <= seen
        assert alive(family) == set()
        assert group_members(proc.pid) == set()
        assert proc.returncode == (-signal.SIGKILL if mode == "ignore" else -signal.SIGTERM)
    finally:
        for pid in alive({proc.pid} | descendants([proc.pid])):
            os.kill(pid, signal.SIGKILL)


# --- the simulated engine through the launcher ------------------------------------------------

SIM_ENV = {"SPECTUNE_SIM_TIME_SCALE": "0.02", "SPECTUNE_SIM_NOISE": "0", "SPECTUNE_SIM_SPEED": "50"}


def sim_engine(tmp_path: Path, *, startup_timeout_s: float = DEADLINE_S, **env: str) -> EngineConfig:
    return EngineConfig(
        python=sys.executable,
        module="spectune_sim",
        port=free_port(),
        env={**SIM_ENV, **env},
        log_dir=tmp_path / "logs",
        startup_timeout_s=startup_timeout_s,
        stop_timeout_s=10.0,
    )


def trial(steps: int = 3, topk: int = 1, ndt: int = 4, **changes: object) -> ServerSettings:
    base = ServerSettings(
        target="dense-8b-h100",
        draft="dense-8b-eagle3",
        attention_backend="fa3",
        max_running_requests=8,
        cuda_graph_max_bs=8,
        speculative=SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=ndt),
    )
    return base.model_copy(update=changes)


@pytest.fixture
def launchers() -> Iterator[list[Launcher]]:
    made: list[Launcher] = []
    yield made
    for launcher in made:  # nothing a failed test started may outlive it
        launcher.stop()


def launch(
    launcher: Launcher,
    settings: ServerSettings,
    *,
    landscape: str = "dense-8b-h100",
    version: str = "0.5.23",
    **kw: object,
) -> RunningServer:
    return launcher.launch(
        settings,
        version=version,
        model_path=f"sim/{landscape}",
        draft_model_path=None if settings.speculative is None else f"sim/{landscape}-eagle3",
        **kw,  # type: ignore[arg-type]
    )


def test_ready_server_reports_effective_settings_and_stops_completely(
    tmp_path: Path, launchers: list[Launcher]
) -> None:
    launcher = Launcher(sim_engine(tmp_path))
    launchers.append(launcher)
    phases: list[str] = []
    server = launch(launcher, trial(steps=3, topk=2, ndt=6), on_phase=phases.append)
    assert launcher.current is server
    assert server.is_alive() and server.death() is None
    assert phases[0] == "stopping_previous" and phases[-1] == "ready" and "warming_up" in phases
    assert server.startup_s > 0
    assert server.effective["speculative_num_steps"] == 3
    assert server.effective["speculative_eagle_topk"] == 2
    assert server.effective["speculative_num_draft_tokens"] == 6
    assert server.effective["attention_backend"] == "fa3"
    assert server.effective["max_running_requests"] == 8
    assert server.mismatches == {}
    assert server.log_path.parent == tmp_path / "logs" and server.log_tail()
    # SGLang-like: the server runs a child; both are in the server's own process group.
    group = group_members(server.pgid)
    assert server.pid in group and len(group) >= 2
    assert server.pgid != os.getpgrp()
    launcher.stop()
    assert alive(group) == set() and group_members(server.pgid) == set()
    assert launcher.current is None and not server.is_alive()
    launcher.stop()  # idempotent


def test_forced_draft_token_count_is_recorded_as_a_mismatch(tmp_path: Path, launchers: list[Launcher]) -> None:
    launcher = Launcher(sim_engine(tmp_path))
    launchers.append(launcher)
    server = launch(launcher, trial(steps=3, topk=1, ndt=8))
    assert server.effective["speculative_num_draft_tokens"] == 4
    assert server.mismatches == {"speculative_num_draft_tokens": (8, 4)}


def test_relaunch_stops_the_previous_server_first(tmp_path: Path, launchers: list[Launcher]) -> None:
    launcher = Launcher(sim_engine(tmp_path))
    launchers.append(launcher)
    first = launch(launcher, trial().baseline())
    first_group = group_members(first.pgid)
    assert first.effective.get("speculative_algorithm") is None
    second = launch(launcher, trial())
    assert alive(first_group) == set()
    assert launcher.current is second and second.log_path != first.log_path


def test_flag_name_for_another_version_is_invalid_config_and_host_fault(
    tmp_path: Path, launchers: list[Launcher]
) -> None:
    # The host has 0.5.23 but the argv was built for 0.5.13: --cuda-graph-max-bs is ambiguous there.
    launcher = Launcher(sim_engine(tmp_path, SPECTUNE_SIM_SGLANG_VERSION="0.5.23"))
    launchers.append(launcher)
    with pytest.raises(LaunchError) as info:
        launch(launcher, trial(), version="0.5.13")
    err = info.value
    assert (err.kind, err.host_fault) == ("invalid_config", True)
    assert "--cuda-graph-max-bs" in err.message and "--cuda-graph-max-bs" in err.log_tail
    failure = err.to_failure()
    assert failure.kind == "invalid_config" and failure.host_fault
    assert launcher.current is None


def test_memory_tight_landscape_with_a_huge_config_is_oom(tmp_path: Path, launchers: list[Launcher]) -> None:
    launcher = Launcher(sim_engine(tmp_path))
    launchers.append(launcher)
    huge = trial(steps=10, topk=8, ndt=64, max_running_requests=64, cuda_graph_max_bs=64)
    with pytest.raises(LaunchError) as info:
        launch(launcher, huge, landscape="mem-tight")
    assert (info.value.kind, info.value.host_fault) == ("oom", False)
    assert "out of memory" in info.value.message.lower()


def test_server_that_never_gets_ready_is_a_launch_timeout_and_is_stopped(
    tmp_path: Path, launchers: list[Launcher]
) -> None:
    launcher = Launcher(sim_engine(tmp_path, startup_timeout_s=3.0, SPECTUNE_SIM_FAULT="hang_startup"))
    launchers.append(launcher)
    before = descendants([os.getpid()])
    with pytest.raises(LaunchError) as info:
        launch(launcher, trial())
    assert info.value.kind == "launch_timeout" and not info.value.host_fault
    assert "3 s" in info.value.message
    assert descendants([os.getpid()]) <= before  # nothing of it left


def test_cancel_during_startup_stops_the_server(tmp_path: Path, launchers: list[Launcher]) -> None:
    launcher = Launcher(sim_engine(tmp_path, SPECTUNE_SIM_FAULT="hang_startup"))
    launchers.append(launcher)
    cancel = threading.Event()
    started: set[int] = set()
    # This process's children from before (another test's pool, in the same pytest process) are not the launch's.
    before = descendants([os.getpid()])

    def on_phase(phase: str) -> None:
        if phase == "waiting_for_port":  # the server process exists now
            started.update(descendants([os.getpid()]) - before)
            threading.Timer(0.5, cancel.set).start()

    t0 = time.monotonic()
    with pytest.raises(LaunchCancelled):
        launch(launcher, trial(), cancel=cancel, on_phase=on_phase)
    assert time.monotonic() - t0 < DEADLINE_S  # not the start-up timeout
    assert started and alive(started) == set()
    assert launcher.current is None


def test_server_killed_after_readiness_is_a_crash(tmp_path: Path, launchers: list[Launcher]) -> None:
    launcher = Launcher(sim_engine(tmp_path))
    launchers.append(launcher)
    server = launch(launcher, trial())
    os.kill(server.pid, signal.SIGKILL)
    wait_for("the server to stop", lambda: not server.is_alive(), DEADLINE_S)
    death = server.death()
    assert death is not None and death.kind == "crash" and "SIGKILL" in death.message
    assert server.returncode == -signal.SIGKILL
    assert classify_exit(-signal.SIGKILL, server.log_tail())[0] == "crash"
    launcher.stop()  # the orphaned child goes too
    assert group_members(server.pgid) == set()


def test_server_crashing_on_its_own_after_readiness(tmp_path: Path, launchers: list[Launcher]) -> None:
    launcher = Launcher(sim_engine(tmp_path, SPECTUNE_SIM_FAULT="crash_after:1"))
    launchers.append(launcher)
    server = launch(launcher, trial())
    wait_for("the server to stop", lambda: not server.is_alive(), DEADLINE_S)
    death = server.death()
    assert death is not None and death.kind == "crash" and not death.host_fault
    assert death.log_tail


def test_port_held_by_a_stranger_is_refused_as_a_host_fault(tmp_path: Path, launchers: list[Launcher]) -> None:
    engine = sim_engine(tmp_path)
    launcher = Launcher(engine)
    launchers.append(launcher)
    with socket.socket() as stranger:
        stranger.bind((engine.host, engine.port))
        stranger.listen()
        with pytest.raises(LaunchError) as info:
            launch(launcher, trial())
    assert info.value.host_fault and f"port {engine.port}" in info.value.message
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").iterdir())


class PidsHeldProbe(ScriptedProbe):
    """Reports the launched server's PIDs on GPU 0 while they live and for two polls after."""

    def __init__(self) -> None:
        super().__init__([[]])
        self.pids: set[int] = set()
        self.after_death = 0

    def compute_processes(self) -> list[GpuProcess]:
        self.calls += 1
        live = alive(self.pids)
        if not live:
            self.after_death += 1
            if self.after_death > 2:
                return []
        return [GpuProcess(0, pid, 1024.0) for pid in sorted(self.pids)]


def test_stop_waits_for_the_probe_to_show_the_memory_released(tmp_path: Path, launchers: list[Launcher]) -> None:
    probe = PidsHeldProbe()
    launcher = Launcher(sim_engine(tmp_path), gpu_probe=probe)
    launchers.append(launcher)
    server = launch(launcher, trial())
    probe.pids = group_members(server.pgid)
    launcher.stop()
    assert probe.after_death == 3  # two polls still holding, then released


def test_startup_value_error_is_invalid_config(tmp_path: Path, launchers: list[Launcher]) -> None:
    # topk > 1 with page size > 1 needs flashinfer, fa3 or triton (docs/sglang.md §2 rule 5).
    launcher = Launcher(sim_engine(tmp_path))
    launchers.append(launcher)
    with pytest.raises(LaunchError) as info:
        launch(launcher, trial(steps=3, topk=2, ndt=6, page_size=16, attention_backend="torch_native"))
    assert (info.value.kind, info.value.host_fault) == ("invalid_config", False)
    assert "ValueError" in info.value.message and "page_size" in info.value.message


def test_stop_from_another_thread_cancels_the_launch(tmp_path: Path, launchers: list[Launcher]) -> None:
    launcher = Launcher(sim_engine(tmp_path, SPECTUNE_SIM_FAULT="hang_startup"))
    launchers.append(launcher)
    started: set[int] = set()
    before = descendants([os.getpid()])  # not the launch's (see above)

    def on_phase(phase: str) -> None:
        if phase == "waiting_for_port":
            started.update(descendants([os.getpid()]) - before)
            threading.Timer(0.5, launcher.stop).start()

    with pytest.raises(LaunchCancelled):
        launch(launcher, trial(), on_phase=on_phase)
    assert started and alive(started) == set()
