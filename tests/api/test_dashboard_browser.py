"""The dashboard in a real browser: headless Chromium signs in through spectune's login page,
opens a finished study's trials and a trial's artifact list, and takes a screenshot.

Chromium is driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: JSON
messages separated by NUL bytes on file descriptors 3 and 4), so no websocket client and no
debugging port are needed.  Skipped where Debian's `chromium` is not installed (.ci/run installs
it).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.api.test_report import report_spec, run_simulated_study
from tests.support.api_client import make_settings, make_tokens
from tests.support.helpers import api_server, stop_process_group

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
STUDY = "browser-study"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed"),
]


class DevTools:
    """A minimal DevTools-protocol client over Chromium's debugging pipe."""

    def __init__(self, proc: subprocess.Popen[bytes], to_browser: int, from_browser: int) -> None:
        self.proc = proc
        self._out = to_browser
        self._in = from_browser
        self._buf = b""
        self._next_id = 0
        self.session: str | None = None

    def call(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            msg["sessionId"] = self.session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:  # events arrive interleaved with answers; skip them
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result

    def _read(self, deadline: float) -> dict[str, Any]:
        import select

        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from Chromium")
            ready, _, _ = select.select([self._in], [], [], left)
            if ready:
                chunk = os.read(self._in, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the pipe (exit {self.proc.poll()})")
                self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        parsed: dict[str, Any] = json.loads(raw)
        return parsed

    def evaluate(self, expression: str) -> Any:
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return out.get("result", {}).get("value")

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def wait_for(self, expression: str, timeout: float = 45.0) -> Any:
        """Poll a JS expression until it is truthy (bounded)."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = self.evaluate(expression)
            except RuntimeError:  # the page is navigating: its context is gone for a moment
                last = None
            if last:
                return last
            time.sleep(0.25)
        text = self.evaluate("document.body ? document.body.innerText.slice(0, 500) : ''")
        raise AssertionError(f"timed out waiting for {expression!r}; page shows: {text!r}")

    def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(data)
        return data


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[DevTools]:
    # fd 3: commands to the browser, fd 4: its answers (what --remote-debugging-pipe expects).
    cmd_r, cmd_w = os.pipe()
    ans_r, ans_w = os.pipe()

    def wire_fds() -> None:
        os.dup2(cmd_r, 3)
        os.dup2(ans_w, 4)

    argv = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--remote-debugging-pipe", "--window-size=1400,1250",
        f"--user-data-dir={tmp_path / 'chromium-profile'}", "about:blank",
    ]  # fmt: skip
    with open(tmp_path / "chromium.log", "wb") as log:
        proc = subprocess.Popen(
            # close_fds=False: the pipe ends sit on fds 3 and 4 only after preexec_fn, and
            # close_fds would shut them again; every other fd is non-inheritable (PEP 446).
            argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=wire_fds, close_fds=False,
            start_new_session=True,
        )  # fmt: skip
    os.close(cmd_r)
    os.close(ans_w)
    tools = DevTools(proc, cmd_w, ans_r)
    try:
        target = tools.call("Target.createTarget", url="about:blank")["targetId"]
        tools.session = tools.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        tools.call("Page.enable")
        tools.call("Emulation.setDeviceMetricsOverride", width=1400, height=1250, deviceScaleFactor=1, mobile=False)
        yield tools
    finally:
        os.close(cmd_w)
        os.close(ans_r)
        stop_process_group(proc)


@pytest.fixture
def finished_study(tmp_path: Path, sqlite_template: Path) -> tuple[str, dict[str, str], Path]:
    """A finished simulated study whose trials carry their benchmark JSON and log as artifacts."""
    from api.app import create_app
    from api.artifacts import store_trial_artifacts

    db = tmp_path / "spectune.db"
    shutil.copy(sqlite_template, db)
    url = f"sqlite:///{db}"
    artifacts = tmp_path / "artifacts"
    tokens = make_tokens(url)
    with TestClient(create_app(make_settings(url, artifact_dir=str(artifacts)))) as client:
        ctx = client.app.state.ctx  # type: ignore[attr-defined]

        def upload(study: str, number: int, report: dict[str, Any]) -> None:
            log = (report.get("failure") or {}).get("log_tail") or f"[sim] trial {number}: server ready\n"
            store_trial_artifacts(ctx, study, number, report, log)

        run_simulated_study(client, tokens, report_spec(STUDY, max_trials=6, concurrency=(1,)), before_complete=upload)
    return url, tokens, artifacts


def test_browser_signs_in_and_sees_trials_and_artifacts(
    browser: DevTools, finished_study: tuple[str, dict[str, str], Path], tmp_path: Path
) -> None:
    url, tokens, artifacts = finished_study
    env = {"SPECTUNE_ARTIFACT_DIR": str(artifacts)}
    with api_server(url, log_path=tmp_path / "api.log", env=env) as base:
        # Without a token the dashboard and its API answer 401 (to a browser too).
        for path in ("/dashboard", "/api/studies", "/api/studies/1", "/api/meta"):
            assert httpx.get(base + path, timeout=10).status_code == 401, path

        # The browser is sent to the login page...
        browser.navigate(f"{base}/dashboard/studies/1")
        browser.wait_for("location.pathname === '/login' && !!document.getElementById('token')")
        assert "next=%2Fdashboard%2Fstudies%2F1" in browser.evaluate("location.search")
        # ...a wrong token is refused on the page...
        browser.evaluate("document.getElementById('token').value = 'st_wrong'; document.querySelector('form').submit()")
        browser.wait_for("document.querySelector('.error') && document.querySelector('.error').innerText")
        assert "unknown token" in browser.evaluate("document.querySelector('.error').innerText")
        # ...and a user token signs in and lands on the study it asked for.
        browser.evaluate(
            f"document.getElementById('token').value = {json.dumps(tokens['user'])};"
            "document.querySelector('form').submit()"
        )
        browser.wait_for("location.pathname.startsWith('/dashboard')")
        cookie_visible = browser.evaluate("document.cookie")
        assert "spectune_session" not in cookie_visible  # HttpOnly: scripts cannot read it

        # The study list shows the finished study.
        browser.navigate(f"{base}/dashboard")
        browser.wait_for(f"document.body.innerText.includes({json.dumps(STUDY)})")
        # Read-only: the Create and Delete buttons (each would answer 403) are drawn but hidden,
        # while Reload stays.
        shown = "[...document.querySelectorAll('button')].filter(b => b.offsetParent !== null)"
        browser.wait_for(f"{shown}.some(b => b.textContent.trim() === 'Reload')")
        browser.wait_for("!!document.querySelector('button[data-spectune-readonly]')")
        labels = browser.evaluate(
            f"JSON.stringify({shown}.map(b => b.getAttribute('aria-label') || b.textContent.trim()))"
        )
        assert "Reload" in json.loads(labels), labels
        assert not {"Create", "Delete", "delete study"} & set(json.loads(labels)), labels
        assert browser.evaluate("!!document.querySelector('button[aria-label=\"delete study\"]')")

        # Its trials, with the selected trial's artifact list.
        browser.navigate(f"{base}/dashboard/studies/1/trials")
        browser.wait_for("document.body.innerText.includes('Trial 0')")
        browser.wait_for("document.body.innerText.includes('benchmark.json')")
        text = browser.evaluate("document.body.innerText")
        assert "Artifacts" in text and "server-log-tail.txt" in text
        assert "speedup" in text  # the metric name
        shot = browser.screenshot(tmp_path / "dashboard-trials.png")
        assert shot.startswith(b"\x89PNG") and len(shot) > 20_000

        # The study's note: spec, baseline, best so far and verdict.
        browser.navigate(f"{base}/dashboard/studies/1/note")
        browser.wait_for("document.body.innerText.includes('Best so far')")
        note = browser.evaluate("document.body.innerText")
        assert "Baseline (no speculation)" in note and "Verdict" in note
        browser.screenshot(tmp_path / "dashboard-note.png")

        # Signing out drops the session: the dashboard's API answers 401 again.
        browser.navigate(f"{base}/logout")
        browser.wait_for("location.pathname === '/login'")
        status = browser.evaluate("fetch('/api/studies').then(r => r.status)")
        assert status == 401
