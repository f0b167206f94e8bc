"""`spectune doctor`: a host checked for its first real run, one line per check, and its bundle.

The engine is the simulator (through the worker's own launcher, a real process on loopback);
NVML is absent here, so GPU problems are shown with a probe holding a host's answers, the seam
the worker itself uses (workers/gpu.py GpuProbe).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

from tests.support.helpers import SIM_ENV, processes_marked, sim_worker_toml, wait_for, write_token
from workers.doctor.run import EXIT_FAILED, EXIT_OK, run
from workers.gpu import GpuDevice, GpuProcess
from workers.lifeline import RUN_ID_ENV

TOKEN = "spectune_w_" + "k3Yq9" * 8  # a token as `spectune token create` prints one
HF_SECRET = "hf_" + "s3cr3t" * 6


def _host(root: Path, **engine: object) -> Path:
    """A sim worker's folder: config, token, registry folders (named for the simulator's landscape)."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("moe-pcie", "moe-pcie-eagle3"):
        (root / "models" / name).mkdir(parents=True, exist_ok=True)
    write_token(root, TOKEN)
    toml = sim_worker_toml(
        api_url="http://127.0.0.1:9",
        worker_id="doc-1",
        models={"moe-pcie": "models/moe-pcie", "moe-pcie-eagle3": "models/moe-pcie-eagle3"},
        engine={"log_dir": "logs", **engine},
        # The worker's token also under a name that does not look secret (pasted by mistake): the
        # bundle still must not carry it.
        engine_env={**SIM_ENV, "HF_TOKEN": HF_SECRET, "SIM_NOTE": f"copied {TOKEN} here"},
        timeouts={"startup_s": 120, "stop_s": 10, "gpu_release_s": 10},
    )
    (root / "worker.toml").write_text(toml)
    return root / "worker.toml"


def _doctor(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`spectune doctor` through the console script's own dispatch (spectune/cli.py)."""
    return subprocess.run(
        [sys.executable, "-c", "from spectune.cli import main; main()", "doctor", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        stdin=subprocess.DEVNULL,
        cwd=config.parent,
    )


def _fails(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("FAIL")]


def test_doctor_passes_on_the_simulated_engine_and_its_bundle_keeps_no_secret(tmp_path: Path) -> None:
    config = _host(tmp_path / "host")
    bundle = tmp_path / "bundle.json"
    done = _doctor(config, "--launch", "--draft", "moe-pcie-eagle3", "--bundle", str(bundle))
    assert done.returncode == EXIT_OK, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert _fails(done.stdout) == [] and done.stderr == ""
    for check in ("engine.python", "token_file", "models.moe-pcie", "sglang", "argv baseline", "argv speculative"):
        assert any(line.startswith(f"ok   {check}:") for line in lines), check
    assert any(line.startswith("skip gpus: NVML is not available") for line in lines)
    launch = next(line for line in lines if line.startswith("ok   launch:"))
    assert "baseline server up" in launch and "/metrics has" in launch
    text = bundle.read_text()
    assert TOKEN not in text and HF_SECRET not in text and str(tmp_path) not in text
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o600
    doc = json.loads(text)
    assert doc["versions"]["sglang"] == "0.5.23"
    assert doc["argv"][0][1:3] == ["-m", "spectune_sim"] and "--model-path" in doc["argv"][0]
    assert doc["argv"][0][doc["argv"][0].index("--model-path") + 1] == "moe-pcie"  # the registry name, not the path
    assert doc["launch"]["server_info"] and "ready to roll" in doc["launch"]["log_tail"]
    assert doc["settings"]["engine"]["env"]["HF_TOKEN"] == "<redacted>"


def test_doctor_names_a_wrong_interpreter_and_a_missing_model_each_in_one_line(tmp_path: Path) -> None:
    config = _host(tmp_path / "host", python=str(tmp_path / "no-such-venv" / "bin" / "python"))
    config.write_text(config.read_text().replace('"models/moe-pcie-eagle3"', '"models/moved-away"'))
    bundle = tmp_path / "bundle.json"
    done = _doctor(config, "--launch", "--bundle", str(bundle))
    assert done.returncode == EXIT_FAILED, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    fails = _fails(done.stdout)
    assert len(fails) == 2, done.stdout
    assert fails[0].startswith("FAIL engine.python: ") and "no-such-venv" in fails[0]
    assert fails[1].startswith("FAIL models.moe-pcie-eagle3: ") and "moved-away does not exist" in fails[1]
    assert "skip launch: not started" in done.stdout
    assert TOKEN not in bundle.read_text()


def test_doctor_refuses_an_unsupported_sglang_and_flags_the_installed_one_refuses(tmp_path: Path) -> None:
    old = _doctor(_host(tmp_path / "old", sglang_version="0.5.12"), "--bundle", str(tmp_path / "old.json"))
    assert old.returncode == EXIT_FAILED
    assert [line for line in _fails(old.stdout) if line.startswith("FAIL sglang:")] == _fails(old.stdout)
    assert "make conformance" in old.stdout
    # The config claims 0.5.13 but the engine is 0.5.23: the old graph flag is an ambiguous prefix there.
    claimed = _host(tmp_path / "claimed", sglang_version="0.5.13")
    done = _doctor(claimed, "--bundle", str(tmp_path / "claimed.json"))
    assert done.returncode == EXIT_FAILED
    fails = _fails(done.stdout)
    assert len(fails) == 1 and fails[0].startswith("FAIL argv baseline:") and "ambiguous option" in fails[0]


class _Host:
    """NVML's answers for a host (the GpuProbe seam): devices and the compute processes on them."""

    def __init__(self, indices: list[int], processes: list[GpuProcess] | None = None) -> None:
        self.indices = indices
        self.processes = processes or []

    def devices(self) -> list[GpuDevice]:
        return [GpuDevice(i, "NVIDIA H200", f"GPU-{i}", 143771.0, 512.0) for i in self.indices]

    def compute_processes(self) -> list[GpuProcess]:
        return list(self.processes)

    def driver_version(self) -> str | None:
        return "560.35"


def test_doctor_names_gpu_count_mismatches_and_other_processes(tmp_path: Path) -> None:
    config = _host(tmp_path / "host")
    config.write_text("gpus = [0, 1, 2, 3]\n" + config.read_text())
    lines: list[str] = []
    assert run(config, probe=_Host([0, 1]), bundle=tmp_path / "b1.json", out=lines.append) == EXIT_FAILED
    assert _fails("\n".join(lines)) == [
        "FAIL gpus: GPU index(es) [2, 3] are not on this host (NVML sees [0, 1]); fix the `gpus` list in the worker config"
    ]
    lines.clear()
    busy = _Host([0, 1, 2, 3], [GpuProcess(gpu_index=2, pid=4242, used_mib=2048.0)])
    assert run(config, probe=busy, tp=8, bundle=tmp_path / "b2.json", out=lines.append) == EXIT_FAILED
    fails = _fails("\n".join(lines))
    assert len(fails) == 2, lines
    assert fails[0].startswith("FAIL gpus: the launch needs 8 GPU(s)") and "--tp 4" in fails[0]
    assert fails[1].startswith("FAIL gpu 2: NVIDIA H200: other processes hold it (pid 4242 (2.0 GiB))")
    lines.clear()
    assert run(config, probe=_Host([0, 1, 2, 3]), bundle=tmp_path / "b3.json", out=lines.append) == EXIT_OK
    assert "ok   gpu 3: NVIDIA H200, 139.9 of 140.4 GiB free" in lines
    assert json.loads((tmp_path / "b3.json").read_text())["versions"]["nvidia_driver"] == "560.35"


def test_a_doctor_stopped_during_its_launch_stops_the_server(tmp_path: Path) -> None:
    # A slow start-up (the modelled minutes at 5%, about a minute), so the server is still
    # starting when the signal comes.
    config = _host(tmp_path / "host")
    config.write_text(
        config.read_text().replace('SPECTUNE_SIM_TIME_SCALE = "0.002"', 'SPECTUNE_SIM_TIME_SCALE = "0.05"')
    )
    argv = [sys.executable, "-c", "from spectune.cli import main; main()", "doctor", "--config", str(config)]
    proc = subprocess.Popen(
        [*argv, "--launch", "--bundle", str(tmp_path / "b.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        cwd=config.parent,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # each line as its check ends; the launch comes after the argv check
            if line.startswith("ok   argv baseline"):
                break
        run_id = os.environ[RUN_ID_ENV]
        engines = lambda: [p for p in processes_marked(f"{RUN_ID_ENV}={run_id}") if "spectune_sim" in p[1]]  # noqa: E731
        wait_for("the baseline server to start", engines, timeout=60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert engines() == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
