"""A saturated measurement is not a measurement (issue 17, item 6).

The simulated engine sped up on a host whose cores are all busy: the engine's steps run late
and the figure measures the host.  The load checks must mark such a level, say why, and the
API must derive no interval from it; the same engine on a host with room is not marked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from optimizer.analysis import level_intervals
from spectune_protocol import LevelMetrics
from tests.support.helpers import sim_engine
from workers.launcher.processes import group_members
from workers.lifeline import child_env
from workers.loadgen import load_prompts, make_client, run_level
from workers.loadgen.saturation import LevelWatch, engine_probe
from workers.loadgen.stats import PassResult

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def simulator(speed: float, log_path: Path) -> Iterator[tuple[str, int]]:
    """The simulated engine at `speed` (baseline server, metrics on); yields (url, process group)."""
    args = [
        "--model-path", "sim/moe-pcie", "--max-running-requests", "16", "--cuda-graph-max-bs-decode", "16",
        "--enable-metrics",
    ]  # fmt: skip
    env = {"SPECTUNE_SIM_TIME_SCALE": "0.002", "SPECTUNE_SIM_SPEED": str(speed)}
    with sim_engine(args, log_path=log_path, env=env) as (url, pgid):
        yield url, pgid


# A core kept busy until it is told to stop, or until its parent is gone: a pytest killed
# outright (SIGKILL, a CI timeout) must not leave loops spinning on the host forever.  The
# lifeline (workers/lifeline.py, armed by child_env) watches from a thread; the default SIGTERM
# it sends ends the loop.
BUSY_LOOP = "from workers.lifeline import exit_with_parent\nexit_with_parent()\nwhile True: pass"


def start_busy_loop() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", BUSY_LOOP], env=child_env(), start_new_session=True)


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """`n` processes spinning on a core each, killed (with their groups) on the way out."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(start_busy_loop())
        yield
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _measure(url: str, pgid: int, concurrency: int, output_len: int) -> LevelMetrics:
    async def go() -> LevelMetrics:
        async with make_client(60.0) as client:
            return await run_level(
                client,
                url,
                load_prompts("builtin:chat", None),
                concurrency=concurrency,
                num_prompts=2 * concurrency,
                output_len=output_len,
                warmup_requests=1,
                repeats=3,
                request_timeout_s=60.0,
                engine_pids=lambda: sorted(group_members(pgid)),
            )

    return asyncio.run(go())


def test_a_sped_up_engine_on_busy_cores_is_flagged_saturated(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="spectune.loadgen")
    with simulator(50.0, tmp_path / "sim.log") as (url, pgid), busy_loops(2 * (os.cpu_count() or 1)):
        m = _measure(url, pgid, 8, 128)
    # The first timed passes fail the check here (the engine waited 0.59-0.66 of the time for a
    # CPU, against the 0.4 limit; CI once saw 0.59 pass a 0.6 limit).  Their re-measurement
    # usually fails too (then the level carries `saturated`); should it pass, the level is the
    # second, checked measurement: either way no saturated figure is reported as a clean one.
    assert "concurrency 8: saturated measurement" in caplog.text, m
    assert m.saturated is None or "measured twice" in m.saturated, m
    assert m.load_check, m
    # The figure is kept, but no interval is derived from a level marked saturated.  (When the
    # re-measurement passed its check the level is clean and rightly gets one: mark it here, so
    # the API's rule is asserted in both cases; CI once saw the unmarked case fail this line.)
    marked = m if m.saturated is not None else m.model_copy(update={"saturated": "saturated measurement"})
    base = m.model_copy(update={"saturated": None}).model_dump(mode="json")
    assert level_intervals([marked.model_dump(mode="json")], [base]) == {}
    assert 8 in level_intervals([base], [base])


def test_the_same_engine_in_real_time_is_not_flagged(tmp_path: Path) -> None:
    with simulator(2.0, tmp_path / "sim.log") as (url, pgid):
        m = _measure(url, pgid, 4, 64)
    assert m.saturated is None, m
    # The checks did run: the generator's and the engine's processes were read, and the engine's queue.
    assert {"cpu_demand", "send_lag_ms", "engine_wait_share", "engine_running_mean"} <= m.load_check.keys(), m


def test_the_engine_probe_reads_running_and_queued_requests(tmp_path: Path) -> None:
    with simulator(2.0, tmp_path / "sim.log") as (url, _):

        async def go() -> tuple[float, float] | None:
            async with make_client(10.0) as client:
                return await engine_probe(client, url)()

        assert asyncio.run(go()) == (0.0, 0.0)


def test_a_watch_over_too_short_a_window_says_nothing() -> None:
    async def go() -> str | None:
        async with LevelWatch(4) as w:
            await asyncio.sleep(0)
        return w.check([PassResult(wall_s=0.01, requests=[])]).saturated

    assert asyncio.run(go()) is None


def test_a_verdict_on_a_saturated_level_is_no_answer() -> None:
    from optimizer.analysis import Interval
    from optimizer.answer import Answer, verdict
    from optimizer.confirmation import saturated_levels

    levels = [{"concurrency": 1}, {"concurrency": 16, "saturated": "the engine waited for a CPU 80% of the time"}]
    sat = saturated_levels(levels, [{"concurrency": 16}])
    assert sat == {16: "the engine waited for a CPU 80% of the time"}
    text = verdict(Answer(2.6, Interval(2.6, 2.4, 2.9), label="2/1/3", confirmed=True, saturated=sat), measured=5)
    assert text.startswith("no answer") and "concurrency 16 is saturated" in text and "80%" in text
    clean = verdict(Answer(2.6, Interval(2.6, 2.4, 2.9), label="2/1/3", confirmed=True, saturated={}), measured=5)
    assert clean.startswith("speculation pays")


def test_hosts_whose_baselines_disagree_beyond_their_noise_are_named() -> None:
    from optimizer.confirmation import host_disagreement

    def lv(rate: float) -> list[dict[str, object]]:
        return [{"concurrency": 16, "output_tok_s": rate, "output_tok_s_runs": [rate * 0.99, rate, rate * 1.01]}]

    # The two identical hosts: 22,318 and 29,850 tok/s at concurrency 16.
    text = host_disagreement({"w1": lv(22318.0), "w2": lv(29850.0)})
    assert text is not None and "22,318" in text and "w2" in text and "saturated" in text
    assert host_disagreement({"w1": lv(22318.0), "w2": lv(23000.0)}) is None  # 3%: hosts differ a little
    assert host_disagreement({"w1": lv(22318.0)}) is None
    # Passes as spread as the gap: nothing to say beyond the noise.
    wide = [{"concurrency": 16, "output_tok_s": 26000.0, "output_tok_s_runs": [18000.0, 26000.0, 34000.0]}]
    assert host_disagreement({"w1": wide, "w2": lv(29850.0)}) is None


def _gone(pid: int) -> bool:
    """Has `pid` exited (gone, or a zombie its new parent has not reaped yet)?"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_a_busy_loop_ends_when_its_parent_is_killed_outright() -> None:
    """A parent SIGKILLed (as pytest may be) takes its busy loops with it: none spins on."""
    parent_code = (
        "import sys\n"
        "from tests.workers.test_saturation import start_busy_loop\n"
        "p = start_busy_loop()\n"
        "print(p.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=child_env(),
        start_new_session=True,
    )
    assert parent.stdout is not None
    loop = int(parent.stdout.readline())
    try:
        assert not _gone(loop)  # it spins while its parent lives
        parent.kill()
        parent.wait(10)
        for _ in range(300):  # the lifeline polls every 0.5 s; bounded at ~30 s
            if _gone(loop):
                break
            time.sleep(0.1)
        assert _gone(loop), "the busy loop outlived its parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(loop, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
