"""Deployment files: the compose file validates, the worker unit passes systemd's own checks.

`docker compose config` (or the older `docker-compose config`) and `systemd-analyze` run where
they are installed and are skipped elsewhere; the structural checks below run everywhere.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
UNIT = ROOT / "workers" / "systemd" / "spectune-worker.service"
DOCKERFILE = ROOT / "Dockerfile"


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_compose_config_validates_and_needs_the_password(tmp_path: Path) -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    ok = subprocess.run(
        [*cli, "-f", str(COMPOSE), "--profile", "sim", "config"],
        capture_output=True, text=True, timeout=60, env={**env, "SPECTUNE_DB_PASSWORD": "s3cret"},
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    resolved = yaml.safe_load(ok.stdout)
    assert set(resolved["services"]) == {"db", "migrate", "api", "sim-token", "sim-worker"}
    url = resolved["services"]["api"]["environment"]["SPECTUNE_DATABASE_URL"]
    assert url == "postgresql+psycopg://spectune:s3cret@db:5432/spectune"
    # Without the password the file refuses to resolve instead of starting an open database.
    missing = subprocess.run(
        [*cli, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=60, env=env
    )  # fmt: skip
    assert missing.returncode != 0 and "SPECTUNE_DB_PASSWORD" in missing.stderr


def test_compose_services_are_wired_in_order() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    db, migrate, api = services["db"], services["migrate"], services["api"]
    assert "pg_isready" in db["healthcheck"]["test"]
    assert migrate["command"] == ["db", "upgrade"] and migrate["restart"] == "no"
    assert migrate["depends_on"]["db"]["condition"] == "service_healthy"
    assert api["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert api["command"][0] == "server" and "/healthz" in " ".join(api["healthcheck"]["test"])
    # The API is published on loopback only; exposing it is a decision for a TLS proxy.
    assert all(str(p).startswith("127.0.0.1:") for p in api["ports"])
    # The simulated worker only under its profile, with a token bound to its worker id.
    assert services["sim-worker"]["profiles"] == ["sim"] and services["sim-token"]["profiles"] == ["sim"]
    token_cmd = services["sim-token"]["command"]
    assert token_cmd[token_cmd.index("--worker-id") + 1] == "sim-1"
    assert 'worker_id = "sim-1"' in DOCKERFILE.read_text()


def test_dockerfile_installs_cpu_torch_before_the_package() -> None:
    text = DOCKERFILE.read_text()
    torch_at = text.index("whl/cpu")
    package_at = text.index("RUN pip install '.[server,gp,sim]'")
    assert torch_at < package_at
    assert re.search(r"^USER spectune$", text, re.M), "the image must not run as root"
    for path in ("api", "optimizer", "workers", "migrations", "spectune", "spectune_protocol"):
        assert f"COPY {path} ./{path}" in text


def test_systemd_unit_passes_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # The unit as shipped, on a machine where /opt/spectune/venv does not exist (verify checks
    # ExecStart's program; the unit starts the worker through env(1) for that reason).
    assert not Path("/opt/spectune/venv").exists()
    text = UNIT.read_text()
    assert "ExecStart=/usr/bin/env /opt/spectune/venv/bin/spectune worker --config /etc/spectune/worker.toml" in text
    unit = tmp_path / UNIT.name
    unit.write_text(text)
    r = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "", r.stderr  # no warnings either (unknown keys are warnings)
    sec = subprocess.run([analyze, "security", "--offline=yes", str(unit)], capture_output=True, text=True, timeout=60)
    exposure = re.search(r"Overall exposure level for \S+: ([0-9.]+)", sec.stdout + sec.stderr)
    assert exposure is not None, sec.stdout + sec.stderr
    # GPU access rules out PrivateDevices and MemoryDenyWriteExecute; everything else is on.
    assert float(exposure.group(1)) <= 4.0


def test_systemd_unit_keeps_its_hardening_and_stop_contract() -> None:
    keys = dict(
        line.split("=", 1) for line in UNIT.read_text().splitlines() if "=" in line and not line.startswith("#")
    )
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
        "KillMode": "mixed",
        "RestartPreventExitStatus": "2",
        "User": "spectune",
    }.items():
        assert keys.get(key) == value, key
    assert "PrivateDevices" not in keys and "MemoryDenyWriteExecute" not in keys  # /dev/nvidia*, CUDA JIT


def test_worker_example_config_and_unit_agree_on_the_venv() -> None:
    # The unit's header installs SGLang into the worker's venv; the example config's engine
    # interpreter must be that venv's (they once pointed at two different venvs).
    text = UNIT.read_text()
    venv = re.search(r"ExecStart=/usr/bin/env (\S+)/bin/spectune ", text)
    assert venv is not None
    assert f"python3 -m venv {venv.group(1)}" in text and f"{venv.group(1)}/bin/pip install" in text
    example = tomllib.loads((UNIT.parent.parent / "worker.example.toml").read_text())
    assert example["engine"]["python"] == f"{venv.group(1)}/bin/python"
    assert "spectune[" not in text  # no install of an unpublished name
