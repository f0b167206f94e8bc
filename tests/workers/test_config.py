"""The worker's TOML config: defaults, path resolution, and errors that name the key to fix."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from workers.config import load_config, read_token
from workers.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "workers" / "worker.example.toml"


def write(tmp_path: Path, body: str, token: str = "tok-123\n") -> Path:
    (tmp_path / "token").write_text(token)
    os.chmod(tmp_path / "token", 0o600)
    (tmp_path / "models" / "llama").mkdir(parents=True, exist_ok=True)
    path = tmp_path / "worker.toml"
    path.write_text(body)
    return path


MINIMAL = """
api_url = "http://127.0.0.1:8000/"
token_file = "token"
"""


def test_minimal_config_gets_defaults_and_absolute_paths(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.api_url == "http://127.0.0.1:8000"  # trailing slash dropped
    assert cfg.token_file == tmp_path / "token"
    assert cfg.outbox_dir == tmp_path / "outbox" and cfg.outbox_dir.is_dir()
    assert cfg.engine.log_dir == tmp_path / "logs" and cfg.engine.log_dir.is_dir()
    assert cfg.engine.module == "sglang.launch_server"
    assert cfg.engine.python == Path(sys.executable)
    assert cfg.worker_id  # hostname
    assert cfg.gpus is None and cfg.models == {}
    assert cfg.timeouts.startup_s == 1200 and cfg.timeouts.heartbeat_s is None
    assert read_token(cfg) == "tok-123"


def test_full_config_resolves_models_relative_to_the_config_file(tmp_path):
    (tmp_path / "prompts").mkdir()
    body = (
        MINIMAL
        + f"""
worker_id = "gpu-host-7"
gpus = [0, 2]
prompt_dir = "prompts"
outbox_dir = "{tmp_path}/state/outbox"
idle_poll_s = 1
idle_poll_max_s = 30

[engine]
python = "python3"
module = "spectune_sim"
port = 31000
env = {{ NCCL_DEBUG = "WARN" }}
sglang_version = "0.5.23"

[timeouts]
startup_s = 900
heartbeat_s = 10

[models]
llama = "models/llama"
"meta-llama/Llama-3.1-8B" = "{tmp_path}/models/llama"

[labels]
rack = "b3"
"""
    )
    cfg = load_config(write(tmp_path, body))
    assert cfg.worker_id == "gpu-host-7" and cfg.gpus == [0, 2]
    assert cfg.models == {
        "llama": tmp_path / "models" / "llama",
        "meta-llama/Llama-3.1-8B": tmp_path / "models" / "llama",
    }
    assert cfg.prompt_dir == tmp_path / "prompts"
    assert cfg.outbox_dir == tmp_path / "state" / "outbox"
    assert cfg.engine.python == Path(shutil.which("python3") or "")
    assert cfg.engine.port == 31000 and cfg.engine.env == {"NCCL_DEBUG": "WARN"}
    assert cfg.timeouts.startup_s == 900 and cfg.timeouts.heartbeat_s == 10
    assert cfg.labels == {"rack": "b3"}


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("[engine]\nprot = 1\n", "engine.prot: unknown key"),
        ("[timeouts]\nstartup = 600\n", "timeouts.startup: unknown key"),
        ("[engine]\nport = 0\n", "engine.port"),
        ('[engine]\nmodule = "sglang.launch_server; rm -rf /"\n', "engine.module"),
        ('[engine]\nenv = { CUDA_VISIBLE_DEVICES = "1" }\n', "top-level `gpus`"),
        ('[engine]\nsglang_version = "latest"\n', "engine.sglang_version"),
        ('[engine]\npython = "/nonexistent/bin/python"\n', "engine.python"),
        ('[engine]\npython = "no-such-python-anywhere"\n', "not on PATH"),
        ("gpus = [0, 0]\n", "gpus"),
        ("gpus = []\n", "leave `gpus` out"),
        ('worker_id = "a b"\n', "worker_id"),
        ('[models]\nllama = "/nonexistent/model"\n', "models.llama: /nonexistent/model does not exist"),
        ('[models]\n"../x" = "models/llama"\n', "not a model name"),
        ('prompt_dir = "nope"\n', "prompt_dir"),
        ("idle_poll_s = 10\nidle_poll_max_s = 5\n", "idle_poll_max_s"),
        ("[timeouts]\nstartup_s = -1\n", "timeouts.startup_s"),
    ],
)
def test_mistakes_name_the_key(tmp_path, extra, needle):
    # Top-level keys must come before any table in TOML.
    body = extra + MINIMAL if not extra.startswith("[") else MINIMAL + extra
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, body))
    assert needle in str(err.value)
    assert str(tmp_path / "worker.toml") in str(err.value)  # which file


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("ftp://api:8000", "not an http(s) URL"),
        ("127.0.0.1:8000", "not an http(s) URL"),
        ("https://user:pw@api.example.com", "no credentials"),
        ("https://api.example.com/?x=1", "base URL only"),
    ],
)
def test_api_url_is_checked(tmp_path, url, needle):
    with pytest.raises(ConfigError, match="api_url") as err:
        load_config(write(tmp_path, f'api_url = "{url}"\ntoken_file = "token"\n'))
    assert needle in str(err.value)


def test_missing_required_keys_and_files(tmp_path):
    with pytest.raises(ConfigError, match="api_url: required key is missing"):
        load_config(write(tmp_path, 'token_file = "token"\n'))
    with pytest.raises(ConfigError, match="token_file: .* does not exist; create it with `spectune token create"):
        load_config(write(tmp_path, 'api_url = "http://x"\ntoken_file = "missing-token"\n'))
    with pytest.raises(ConfigError, match="cannot read worker config"):
        load_config(tmp_path / "nope.toml")


def test_bad_toml_says_where(tmp_path):
    with pytest.raises(ConfigError, match=r"not valid TOML: .*line 1"):
        load_config(write(tmp_path, "api_url = \n"))


def test_token_is_one_word_and_never_in_errors(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL, token="two words\n"))
    with pytest.raises(ConfigError, match="exactly one token") as err:
        read_token(cfg)
    assert "two words" not in str(err.value)
    cfg = load_config(write(tmp_path, MINIMAL, token="\n"))
    with pytest.raises(ConfigError, match="exactly one token"):
        read_token(cfg)


def test_world_readable_token_warns(tmp_path, caplog):
    cfg = load_config(write(tmp_path, MINIMAL))
    os.chmod(cfg.token_file, 0o644)
    assert read_token(cfg) == "tok-123"
    assert "chmod 600" in caplog.text and "tok-123" not in caplog.text


def test_unwritable_outbox_is_refused(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root can write anywhere")
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    with pytest.raises(ConfigError, match="outbox_dir"):
        load_config(write(tmp_path, MINIMAL + f'outbox_dir = "{locked}/outbox"\n'))


def test_example_config_is_valid(tmp_path):
    """The shipped example parses once its paths exist (copied next to a token and models)."""
    text = EXAMPLE.read_text()
    for old in ("/etc/spectune/worker.token", "/var/lib/spectune/outbox", "/var/log/spectune", "/srv/models"):
        text = text.replace(old, str(tmp_path / old.strip("/").replace("/", "_")))
    text = text.replace("/opt/spectune/venv/bin/python", sys.executable)
    (tmp_path / "etc_spectune_worker.token").write_text("t\n")
    for sub in ("llama-3.1-8b-instruct", "eagle3-llama-3.1-8b"):
        (tmp_path / "srv_models" / sub).mkdir(parents=True)
    path = tmp_path / "worker.toml"
    path.write_text(text)
    cfg = load_config(path)
    assert cfg.models and cfg.labels and cfg.api_url.startswith("https://")
