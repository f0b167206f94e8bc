"""The server's argv per SGLang line, its environment, and SGLang version detection (issue 3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from optimizer.sglang import ServerSettings
from optimizer.space import SpecConfig
from tests.support.helpers import sim_worker_toml, write_token
from workers.errors import ConfigError
from workers.launcher import EngineConfig, build_argv, detect_sglang_version, server_env

VERSIONS = ("0.5.13", "0.5.16", "0.5.20", "0.5.23")
# The max-captured-batch flag each line understands (docs/sglang.md §1).
MAX_BS_FLAG = {
    "0.5.13": "--cuda-graph-max-bs",
    "0.5.16": "--cuda-graph-max-bs-decode",
    "0.5.20": "--cuda-graph-max-bs-decode",
    "0.5.23": "--cuda-graph-max-bs-decode",
}
BS_LIST_FLAG = {
    "0.5.13": "--cuda-graph-bs",
    "0.5.16": "--cuda-graph-bs-decode",
    "0.5.20": "--cuda-graph-bs-decode",
    "0.5.23": "--cuda-graph-bs-decode",
}
SPEC_FLAGS = (
    "--speculative-algorithm",
    "--speculative-draft-model-path",
    "--speculative-num-steps",
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
)

ENGINE = EngineConfig(python="/opt/sglang/bin/python", host="127.0.0.1", port=30123)


def trial_settings(**changes: object) -> ServerSettings:
    base = ServerSettings(
        target="kimi",
        draft="kimi-eagle3",
        tp_size=8,
        attention_backend="flashinfer",
        page_size=1,
        max_running_requests=16,
        cuda_graph_max_bs=16,
        speculative=SpecConfig(num_steps=2, topk=4, num_draft_tokens=6),
    )
    return base.model_copy(update=changes)


def value_of(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def trial_argv(version: str, settings: ServerSettings | None = None) -> list[str]:
    return build_argv(
        ENGINE,
        settings or trial_settings(),
        version=version,
        model_path="/models/kimi",
        draft_model_path="/models/kimi-eagle3",
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_trial_argv_has_this_versions_flags(version: str) -> None:
    argv = trial_argv(version)
    assert argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert value_of(argv, "--model-path") == "/models/kimi"
    assert value_of(argv, "--host") == "127.0.0.1"
    assert value_of(argv, "--port") == "30123"
    assert value_of(argv, "--tp-size") == "8"
    assert value_of(argv, "--attention-backend") == "flashinfer"
    assert value_of(argv, "--max-running-requests") == "16"
    assert "--enable-metrics" in argv
    assert value_of(argv, MAX_BS_FLAG[version]) == "16"
    assert value_of(argv, "--speculative-algorithm") == "EAGLE3"
    assert value_of(argv, "--speculative-draft-model-path") == "/models/kimi-eagle3"
    assert value_of(argv, "--speculative-num-steps") == "2"
    assert value_of(argv, "--speculative-eagle-topk") == "4"
    assert value_of(argv, "--speculative-num-draft-tokens") == "6"
    # Typed values only: every element is one argument, nothing a shell would have to split.
    assert all(isinstance(a, str) and a for a in argv)


@pytest.mark.parametrize("version", VERSIONS)
def test_baseline_argv_is_the_trial_argv_without_speculation(version: str) -> None:
    settings = trial_settings()
    baseline = build_argv(
        ENGINE, settings.baseline(), version=version, model_path="/models/kimi", draft_model_path=None
    )
    trial = trial_argv(version, settings)
    for flag in SPEC_FLAGS:
        assert flag not in baseline
    assert "/models/kimi-eagle3" not in baseline
    # Same server otherwise: the pinned backend, max running requests and graph size stay.
    spec_start = trial.index("--speculative-algorithm")
    assert baseline == trial[:spec_start] + trial[spec_start + 2 * len(SPEC_FLAGS) :]
    assert value_of(baseline, "--attention-backend") == "flashinfer"
    assert value_of(baseline, "--max-running-requests") == "16"
    assert "--enable-metrics" in baseline


@pytest.mark.parametrize("version", VERSIONS)
def test_explicit_capture_list_uses_this_versions_flag(version: str) -> None:
    argv = trial_argv(version, trial_settings(cuda_graph_bs=(1, 2, 4, 8)))
    i = argv.index(BS_LIST_FLAG[version])
    assert argv[i + 1 : i + 5] == ["1", "2", "4", "8"]
    assert MAX_BS_FLAG[version] not in argv  # the list wins over the max


@pytest.mark.parametrize("version", ["0.5.20", "0.5.23", "0.6.0"])
@pytest.mark.parametrize("graph", [{"cuda_graph_max_bs": 64}, {"cuda_graph_bs": (1, 2, 4)}, {}])
def test_new_lines_never_get_the_ambiguous_old_names(version: str, graph: dict[str, object]) -> None:
    for settings in (trial_settings(**graph), trial_settings(**graph).baseline()):
        argv = build_argv(ENGINE, settings, version=version, model_path="/m", draft_model_path="/d")
        # As whole elements: argparse would take either as an ambiguous prefix and exit 2.
        assert "--cuda-graph-max-bs" not in argv
        assert "--cuda-graph-bs" not in argv


def test_chain_draft_tokens_go_out_as_sglang_resolves_them() -> None:
    settings = trial_settings(speculative=SpecConfig(num_steps=3, topk=1, num_draft_tokens=8))
    argv = trial_argv("0.5.23", settings)
    assert value_of(argv, "--speculative-num-draft-tokens") == "4"


def test_simulated_engine_module_and_missing_draft_path() -> None:
    sim = EngineConfig(python=sys.executable, module="spectune_sim", port=31000)
    argv = build_argv(sim, trial_settings(), version="0.5.23", model_path="sim/moe-pcie", draft_model_path="d")
    assert argv[:3] == [sys.executable, "-m", "spectune_sim"]
    with pytest.raises(ValueError, match="draft"):
        build_argv(sim, trial_settings(), version="0.5.23", model_path="sim/moe-pcie", draft_model_path=None)


@pytest.mark.parametrize("module", ["sglang.launch_server; rm -rf /", "/opt/x.py", "sglang launch", "", "a..b"])
def test_engine_module_must_be_a_module_name(module: str) -> None:
    with pytest.raises(ConfigError, match="module name"):
        EngineConfig(python=sys.executable, module=module)


def test_engine_config_rejects_bad_numbers() -> None:
    with pytest.raises(ConfigError, match="port"):
        EngineConfig(python=sys.executable, port=70000)
    with pytest.raises(ConfigError, match="startup_timeout_s"):
        EngineConfig(python=sys.executable, startup_timeout_s=0)
    with pytest.raises(ConfigError, match="gpu_indices"):
        EngineConfig(python=sys.executable, gpu_indices=())


def test_server_env_is_minimal_and_config_wins() -> None:
    inherited = {
        "PATH": "/usr/bin",
        "HOME": "/home/w",
        "LC_ALL": "C.UTF-8",
        "NCCL_DEBUG": "INFO",
        "SPECTUNE_TOKEN": "secret",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "CUDA_VISIBLE_DEVICES": "7",
        "SGLANG_ENABLE_SPEC_V2": "0",
    }
    engine = EngineConfig(python=sys.executable, gpu_indices=(2, 3), env={"HF_HUB_OFFLINE": "1", "NCCL_DEBUG": "WARN"})
    env = server_env(engine, inherited)
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/home/w",
        "LC_ALL": "C.UTF-8",
        "NCCL_DEBUG": "WARN",
        "HF_HUB_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "PYTHONUNBUFFERED": "1",
        # The engine stops itself if this worker dies without stopping it (workers/lifeline.py).
        "SPECTUNE_EXIT_WITH_PARENT": str(os.getpid()),
    }
    # Without gpu_indices the worker's own CUDA_VISIBLE_DEVICES (e.g. from systemd) carries over.
    assert server_env(EngineConfig(python=sys.executable), inherited)["CUDA_VISIBLE_DEVICES"] == "7"


def test_version_override_wins_without_running_anything() -> None:
    assert detect_sglang_version("/nonexistent/python", "0.5.16") == "0.5.16"
    assert detect_sglang_version("/nonexistent/python", "v0.5.23") == "0.5.23"
    with pytest.raises(ConfigError, match="sglang_version"):
        detect_sglang_version(sys.executable, "latest")


@pytest.mark.parametrize("version", ["0.5.12", "0.5.23rc1", "0.6.0"])
def test_a_version_outside_the_supported_list_is_refused_in_one_line(version: str) -> None:
    with pytest.raises(ConfigError) as info:
        detect_sglang_version("/nonexistent/python", version)
    message = str(info.value)
    assert "\n" not in message and f"SGLang {version} is" in message
    assert "make conformance" in message and "workers/launcher/supported.py" in message
    assert ("newer than any version" in message) == (version == "0.6.0")


def test_an_installed_version_outside_the_list_is_refused(tmp_path: Path) -> None:
    dist = tmp_path / "sglang-0.5.24.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.24\n")
    env = {"PATH": os.environ.get("PATH", "/usr/bin"), "PYTHONPATH": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"sglang installed for .*: SGLang 0\.5\.24 is newer .*make conformance"):
        detect_sglang_version(sys.executable, env=env)


def test_version_detection_in_a_real_interpreter_without_sglang() -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin")}
    with pytest.raises(ConfigError, match="SGLang is not installed") as info:
        detect_sglang_version(sys.executable, env=env)
    assert sys.executable in str(info.value)


def test_version_detection_reads_the_interpreters_installed_metadata(tmp_path: Path) -> None:
    dist = tmp_path / "sglang-0.5.16.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.16\n")
    env = {"PATH": os.environ.get("PATH", "/usr/bin"), "PYTHONPATH": str(tmp_path)}
    assert detect_sglang_version(sys.executable, env=env) == "0.5.16"


def test_version_detection_with_a_missing_interpreter(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        detect_sglang_version(str(tmp_path / "no-python"))


def test_the_worker_refuses_an_unsupported_version_in_one_line_and_exits_2(tmp_path: Path) -> None:
    (tmp_path / "models" / "moe-pcie").mkdir(parents=True)
    write_token(tmp_path, "spectune_w_token")
    toml = sim_worker_toml(
        api_url="http://127.0.0.1:9",
        worker_id="old-1",
        models={"moe-pcie": "models/moe-pcie"},
        engine={"sglang_version": "0.5.12"},
    )
    (tmp_path / "worker.toml").write_text(toml)
    done = subprocess.run(
        [sys.executable, "-m", "workers.main", str(tmp_path / "worker.toml")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "SGLang 0.5.12 is not one spectune supports" in errors[0], done.stderr
    assert "make conformance" in errors[0] and "Traceback" not in done.stderr
