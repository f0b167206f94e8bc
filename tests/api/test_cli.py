"""The command line: clear one-line errors (no traceback), schema refusal, tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.helpers import free_port


def spectune(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "api.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_server_refuses_an_unmigrated_database_and_names_the_fix(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    r = spectune("server", "--database-url", url, "--port", str(free_port()))
    assert r.returncode == 2
    assert "spectune db upgrade" in r.stderr
    assert "Traceback" not in r.stderr


def test_server_refuses_an_old_spectune_schema(tmp_path: Path) -> None:
    from alembic import command

    from api.schema import alembic_config, upgrade

    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url)
    command.downgrade(alembic_config(url), "base")
    r = spectune("server", "--database-url", url, "--port", str(free_port()))
    assert r.returncode == 2 and "spectune db upgrade" in r.stderr


def test_db_upgrade_then_tokens(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    assert spectune("db", "upgrade", "--database-url", url).returncode == 0
    r = spectune("token", "create", "--role", "bogus", "--database-url", url)
    assert r.returncode == 2 and "unknown role 'bogus'" in r.stderr and "Traceback" not in r.stderr
    r = spectune("token", "create", "--role", "worker", "--worker-id", "gpu-01", "--database-url", url)
    assert r.returncode == 0 and r.stdout.strip().startswith("st_")
    listed = spectune("token", "list", "--database-url", url).stdout
    assert "worker\tactive" in listed and "worker=gpu-01" in listed
    header, first = listed.splitlines()[:2]
    assert header == "id\trole\tstate\tname"
    token_id = first.split("\t")[0]
    assert spectune("token", "revoke", token_id, "--database-url", url).returncode == 0
    assert "worker\trevoked" in spectune("token", "list", "--database-url", url).stdout
    # Running the upgrade again is harmless.
    assert spectune("db", "upgrade", "--database-url", url).returncode == 0


def test_study_commands_without_token_or_api_fail_cleanly(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: x\nmodel: {target: t, draft: d}\n")
    r = spectune("study", "create", "-f", str(spec), "--api-url", f"http://127.0.0.1:{free_port()}", "--token", "st_x")
    assert r.returncode == 2 and "cannot reach the API" in r.stderr
    r = spectune("study", "create", "-f", str(tmp_path / "missing.yaml"), "--token", "st_x")
    assert r.returncode == 2 and "cannot read" in r.stderr
