"""The session secret file is written atomically and repaired (issue 35, item 7).

Seen on cc094f3: ENOSPC while creating the secret left a 0-byte `spectune-session-secret`; after
space was freed every start failed with "must be at least 32 characters" until someone deleted it.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.sessions import MIN_SECRET_CHARS, load_secret, secret_file_path
from tests.support.api_client import make_settings

NO_DATABASE = "sqlite:///unused.db"  # load_secret reads no database


def test_a_start_with_an_empty_secret_file_succeeds_and_logs_the_repair(
    tmp_path: Path, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from api.app import create_app

    settings = make_settings(db_url, artifact_dir=str(tmp_path / "arts"), session_secret=None)
    path = secret_file_path(settings)
    path.write_bytes(b"")  # what the full disk left
    with caplog.at_level(logging.WARNING, logger="spectune.api.sessions"):
        with TestClient(create_app(settings)) as client:
            assert client.get("/healthz").status_code == 200
    assert any("held no usable session secret" in r.getMessage() for r in caplog.records), caplog.text
    value = path.read_text().strip()
    assert len(value) >= MIN_SECRET_CHARS and path.stat().st_mode & 0o777 == 0o600
    assert load_secret(settings) == value.encode()  # the next start keeps the repaired one


@pytest.mark.parametrize("content", [b"short\n", b"\xff\xfe not text"])
def test_a_short_or_unreadable_secret_is_replaced(tmp_path: Path, content: bytes) -> None:
    settings = make_settings(NO_DATABASE, session_secret_file=str(tmp_path / "key"), session_secret=None)
    (tmp_path / "key").write_bytes(content)
    assert len(load_secret(settings)) >= MIN_SECRET_CHARS


def test_a_write_that_fails_leaves_no_secret_file_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = make_settings(NO_DATABASE, session_secret_file=str(tmp_path / "secrets" / "key"), session_secret=None)

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr("api.sessions.os.fsync", full_disk)
        with pytest.raises(OSError, match="No space left"):
            load_secret(settings)
    # Neither a cut secret nor the temporary file: the next start creates it whole.
    assert [p.name for p in (tmp_path / "secrets").iterdir() if not p.name.endswith(".lock")] == []
    assert len(load_secret(settings)) >= MIN_SECRET_CHARS
