"""The CLI's other commands against a real API process: bench, stop/resume, export, show's tables, --version, --help."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from api.cli import app
from tests.api.test_cli_answer import level
from tests.api.test_cli_study import cli
from tests.support.specs import INVENTORY

pytestmark = pytest.mark.slow


def drive(base: str, tokens: dict[str, str], respond: Callable[[dict[str, Any]], dict[str, Any]]) -> list[Any]:
    """Lease and complete as worker w1 until it gets no work; returns the leases."""
    h = {"Authorization": f"Bearer {tokens['worker']}"}
    handed = []
    with httpx.Client(base_url=base, timeout=30) as c:
        for _ in range(40):
            r = c.post("/v1/workers/w1/lease", headers=h, json=INVENTORY)
            if r.status_code == 204:
                break
            lease = r.json()
            handed.append(lease)
            assert c.post(f"/v1/leases/{lease['lease_id']}/complete", headers=h, json=respond(lease)).status_code == 200
    return handed


def ok(tok_s: float, levels: list[int]) -> dict[str, Any]:
    return {"outcome": "ok", "metrics": {"levels": [level(c, tok_s) for c in levels], "sglang_version": "0.5.23"}}


def test_bench_stop_resume_export_and_show(server: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    base, tokens = server
    user = tokens["user"]
    args = ["--target", "moe-pcie", "--draft", "moe-pcie-eagle3", "--concurrency", "1,4", "--name", "b1"]
    r = cli(base, user, "bench", *args, "--config", "3/1/4", "--config", "2/2/4", "--config", "4/1/9")
    assert r.returncode == 0, r.stderr
    # 4/1/9 is the chain 4/1/5 (SGLang sets draft tokens to steps + 1): three distinct configurations.
    assert "created study b1: 3 configurations" in r.stdout
    shown = json.loads(cli(base, user, "study", "show", "b1", "--json").stdout)
    assert shown["spec"]["sampler"] == "list" and shown["spec"]["confirmation"]["top"] == 0
    assert shown["spec"]["model"]["tp_size"] == 1
    # Without -f, --tp-size reaches the model; with -f after `study create -f`, the bench study
    # gets its own name instead of the spec's (which the search study holds: 409 before).
    r = cli(base, user, "bench", "--target", "moe-pcie", "--draft", "moe-pcie-eagle3", "--tp-size", "8",
            "--name", "b8", "--config", "3/1/4")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(cli(base, user, "study", "show", "b8", "--json").stdout)["spec"]["model"]["tp_size"] == 8
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(json.dumps({"name": "searched", "model": {"target": "moe-pcie", "draft": "moe-pcie-eagle3"}}))
    assert cli(base, user, "study", "create", "-f", str(spec_file)).returncode == 0
    r = cli(base, user, "bench", "-f", str(spec_file), "--config", "3/1/4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("created study searched-bench-") and "1 configurations" in r.stdout
    for study in ("b8", "searched", r.stdout.split()[2].rstrip(":")):
        assert cli(base, user, "study", "stop", study).returncode == 0  # the worker below serves b1 only

    # Stopped: no work for anyone; resumed: work again.
    r = cli(base, user, "study", "stop", "b1")
    assert r.returncode == 0 and r.stdout.strip() == "study b1 is stopped"
    assert drive(base, tokens, lambda lease: ok(100.0, [1, 4])) == []
    r = cli(base, user, "study", "resume", "b1")
    assert r.returncode == 0 and r.stdout.strip() == "study b1 is running"

    def respond(lease: dict[str, Any]) -> dict[str, Any]:
        if lease["kind"] == "baseline":
            return ok(100.0, [1, 4])
        if lease["config"]["topk"] == 2:
            return {"outcome": "failed", "failure": {"kind": "oom", "message": "CUDA out of memory in the draft graph"}}
        # A slow chain at level 1 would be pruned in a search; a benchmark measures every level.
        return ok(60.0 if lease["config"]["num_steps"] == 4 else 130.0, [1, 4])

    handed = drive(base, tokens, respond)
    kinds = [le["kind"] for le in handed]
    assert kinds == ["baseline", "trial", "trial", "trial"]
    assert [le["config"]["num_steps"] for le in handed[1:]] == [3, 2, 4]  # the given order, nothing else
    r = cli(base, user, "study", "resume", "b1")
    assert r.returncode == 2 and "is finished" in r.stderr

    r = cli(base, user, "study", "show", "b1")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "baseline w1: 100.0 tok/s @1, 100.0 tok/s @4" in out
    assert next(line for line in out.splitlines() if line.startswith("level")).split()[:3] == [
        "level",
        "baseline",
        "tok/s",
    ]
    assert "CUDA out of memory in the draft graph" in out  # the failure's reason, not only its kind

    r = cli(base, user, "study", "export", "b1")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    measured = [row for row in rows if row["concurrency"]]
    assert len(measured) == 4 and {row["concurrency"] for row in measured} == {"1", "4"}
    assert all(row["baseline_tok_s"] == "100.0" for row in measured)
    slow = [row for row in measured if row["num_steps"] == "4"]
    assert len(slow) == 2 and float(slow[0]["speedup"]) == pytest.approx(0.6)
    failed = [row for row in rows if row["failure_kind"]]
    assert len(failed) == 1 and failed[0]["failure_message"] == "CUDA out of memory in the draft graph"
    target = tmp_path / "b1.json"
    r = cli(base, user, "study", "export", "b1", "--format", "json", "-o", str(target))
    assert r.returncode == 0, r.stderr
    doc = json.loads(target.read_text())
    assert doc["study"]["name"] == "b1" and len(doc["trials"]) == 3

    # A study no worker can take: show says so.
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: nowhere\nmodel: {target: moe-pcie, draft: moe-pcie-eagle3}\nplacement: {gpu: b200}\n")
    assert cli(base, user, "study", "create", "-f", str(spec)).returncode == 0
    r = cli(base, user, "study", "show", "nowhere")
    assert "WARNING  no registered worker can take this study: no worker carries the placement labels gpu=b200" in (
        r.stdout
    )
    r = cli(base, user, "study", "watch", "nowhere", "--timeout", "0")
    assert r.returncode == 1 and "WARNING: no registered worker can take this study" in r.stdout


def test_cli_errors_are_one_line(server: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    base, tokens = server
    for args, message in [
        (["bench", "--target", "t", "--draft", "d", "--config", "3x1"], "write steps/topk/draft_tokens"),
        (["bench", "--config", "3/1/4"], "give -f SPEC, or --target and --draft"),
        (["study", "export", "nope"], "404"),
        (["study", "stop", "nope"], "404"),
        (["study", "best", "b", "--worker-config", str(tmp_path / "missing.toml")], "cannot read worker config"),
    ]:
        r = cli(base, tokens["user"], *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # A spec mistake answers with the fix.
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nmodel: {target: a, draft: b}\nsearch_space: {num_draft_tokens: 16}\n")
    r = cli(base, tokens["user"], "study", "create", "-f", str(spec))
    assert r.returncode == 2 and "write {low: 16, high: 16}" in r.stderr
    spec.write_text(
        "name: s\nmodel: {target: a, draft: b}\nsearch_space: {topk: [1], num_draft_tokens: {low: 4, high: 4}}\n"
    )
    r = cli(base, tokens["user"], "study", "create", "-f", str(spec))
    assert r.returncode == 2 and "remove num_draft_tokens" in r.stderr


def test_version_and_help_on_every_command() -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"spectune {version('spectune')}"
    root = typer.main.get_command(app)

    def walk(group: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
        for name, cmd in group.commands.items():
            yield [*path, name], cmd
            if hasattr(cmd, "commands"):  # a group (typer may ship its own click)
                yield from walk(cmd, [*path, name])

    commands = list(walk(root, []))
    assert {"bench", "study stop", "study resume", "study export"} <= {" ".join(p) for p, _ in commands}
    for path, cmd in commands:
        assert (cmd.help or "").strip(), f"`spectune {' '.join(path)}` has no help text"
        r = runner.invoke(app, [*path, "--help"])
        assert r.exit_code == 0 and "Usage:" in r.stdout, path
