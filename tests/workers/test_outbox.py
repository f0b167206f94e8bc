"""The on-disk outbox: durable before sending, removed only on acknowledgement, rejects kept."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from spectune_protocol import CompleteIn, Failure, LevelMetrics, Metrics
from workers.client import ApiClient, Backoff, make_http_client
from workers.outbox import Outbox, deliver_pending


def ok_report(tok_s: float = 123.4) -> CompleteIn:
    return CompleteIn(
        outcome="ok",
        metrics=Metrics(
            levels=[LevelMetrics(concurrency=1, output_tok_s=tok_s)], startup_s=3.0, sglang_version="0.5.23"
        ),
    )


def failed_report() -> CompleteIn:
    return CompleteIn(outcome="failed", failure=Failure(kind="oom", message="CUDA out of memory", log_tail="x" * 100))


def client_for(handler) -> ApiClient:
    http = make_http_client("http://api.test", timeout_s=5, transport=httpx.MockTransport(handler))
    # A wait that says "stopping" ends retries at once: each delivery is one attempt.
    return ApiClient(http, token="t", worker_id="w", backoff=Backoff(initial_s=0.01), wait=lambda s: True)


def test_put_is_durable_and_round_trips(tmp_path):
    box = Outbox(tmp_path / "outbox")
    path = box.put("L-1", ok_report())
    assert path.name == "L-1.json" and len(box) == 1
    assert not list(box.root.glob(".*.tmp"))  # nothing half-written left behind
    (item,) = box.pending()
    assert item.lease_id == "L-1" and item.report == ok_report()
    # Writing the same lease again replaces, never duplicates.
    box.put("L-1", ok_report(200.0))
    (item,) = box.pending()
    assert item.report.metrics is not None and item.report.metrics.levels[0].output_tok_s == 200.0


def test_reports_survive_a_process_that_dies_right_after_put(tmp_path):
    root = tmp_path / "outbox"
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from spectune_protocol import CompleteIn, Failure\n"
        "from workers.outbox import Outbox\n"
        "Outbox(Path(sys.argv[1])).put('L-9', CompleteIn(outcome='failed', failure=Failure(kind='crash', message='m')))\n"
        "os._exit(9)\n"  # no clean-up, no flush at exit
    )
    done = subprocess.run([sys.executable, "-c", code, str(root)], timeout=60, check=False)
    assert done.returncode == 9
    (item,) = Outbox(root).pending()
    assert item.lease_id == "L-9" and item.report.failure is not None and item.report.failure.kind == "crash"


def test_odd_lease_ids_get_safe_file_names(tmp_path):
    box = Outbox(tmp_path)
    path = box.put("../../etc/passwd", failed_report())
    assert path.parent == tmp_path and path.name.startswith("lease-")
    assert [i.lease_id for i in box.pending()] == ["../../etc/passwd"]


def test_half_written_and_corrupt_files_are_set_aside(tmp_path):
    (tmp_path / ".L-3.json.123.tmp").write_text("{")
    (tmp_path / "L-4.json").write_text("not json")
    box = Outbox(tmp_path)
    assert not (tmp_path / ".L-3.json.123.tmp").exists()
    assert box.pending() == []
    assert (tmp_path / "rejected" / "L-4.json").exists()
    assert "unreadable" in (tmp_path / "rejected" / "L-4.json.reason.txt").read_text()


def test_delivery_removes_only_acknowledged_reports(tmp_path):
    box = Outbox(tmp_path)
    box.put("L-1", ok_report())
    box.put("L-2", failed_report())
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        lease = request.url.path.split("/")[3]
        sent.append((lease, json.loads(request.content)["outcome"]))
        return httpx.Response(200, json={"lease_id": lease, "state": "complete"})

    assert deliver_pending(box, client_for(handler)) is True
    assert sorted(sent) == [("L-1", "ok"), ("L-2", "failed")]
    assert len(box) == 0


def test_api_down_keeps_everything(tmp_path):
    box = Outbox(tmp_path)
    box.put("L-1", ok_report())
    box.put("L-2", ok_report())
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("refused", request=request)

    assert deliver_pending(box, client_for(handler)) is False
    assert len(calls) == 1  # the first failure stops the round: the rest would fail the same way
    assert sorted(i.lease_id for i in box.pending()) == ["L-1", "L-2"]


def test_lost_lease_reports_are_dropped_and_rejected_ones_kept(tmp_path, caplog):
    box = Outbox(tmp_path)
    box.put("gone", ok_report())
    box.put("bad", failed_report())

    def handler(request: httpx.Request) -> httpx.Response:
        if "/gone/" in request.url.path:
            return httpx.Response(410, json={"detail": "lease expired"})
        return httpx.Response(422, json={"detail": "metrics missing"})

    assert deliver_pending(box, client_for(handler)) is True
    assert len(box) == 0
    assert (tmp_path / "rejected" / "bad.json").exists()
    assert "metrics missing" in (tmp_path / "rejected" / "bad.json.reason.txt").read_text()
    assert not (tmp_path / "rejected" / "gone.json").exists()
    assert "REJECTED" in caplog.text and "dropping" in caplog.text
