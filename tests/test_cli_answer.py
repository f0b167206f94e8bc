"""`spectune study best` hands over what to deploy: sized by `serving`, and without speculation when it does not pay."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.cli import EXIT_NO_SPECULATION
from optimizer.deploy import placeholder
from tests.conftest import INVENTORY, small_spec
from tests.test_cli_study import cli

pytestmark = pytest.mark.slow


def level(c: int, tok_s: float) -> dict[str, Any]:
    return {"concurrency": c, "output_tok_s": tok_s, "output_tok_s_runs": [tok_s * 0.995, tok_s, tok_s * 1.005]}


def run_fixed(base: str, tokens: dict[str, str], spec: dict[str, Any], trial_tok_s: float) -> dict[str, Any]:
    """Every trial measures `trial_tok_s` against a 100 tok/s baseline at every level; returns the finished study."""
    h = {role: {"Authorization": f"Bearer {t}"} for role, t in tokens.items()}
    levels = spec["workload"]["concurrency"]
    with httpx.Client(base_url=base, timeout=30) as c:
        assert c.post("/v1/studies", headers=h["user"], json=spec).status_code == 201
        for _ in range(40):  # bounded; the budget ends the study well before
            r = c.post("/v1/workers/w1/lease", headers=h["worker"], json=INVENTORY)
            if r.status_code == 204:
                break
            lease = r.json()
            tok = 100.0 if lease["kind"] == "baseline" else trial_tok_s
            body = {"outcome": "ok", "metrics": {"levels": [level(x, tok) for x in levels], "sglang_version": "0.5.23"}}
            assert c.post(f"/v1/leases/{lease['lease_id']}/complete", headers=h["worker"], json=body).status_code == 200
        shown: dict[str, Any] = c.get(f"/v1/studies/{spec['name']}", headers=h["user"]).json()
    assert shown["state"] == "finished"
    return shown


def test_best_honours_the_serving_envelope_and_resolves_models_on_a_worker_host(
    server: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    base, tokens = server
    spec = small_spec("pays", budget={"max_trials": 2}, confirmation={"top": 1})
    spec["workload"] |= {"concurrency": [1, 4]}
    spec["serving"] = {"max_running_requests": 160, "max_batch": 128}
    shown = run_fixed(base, tokens, spec, 150.0)
    assert shown["speculation_pays"] is True and shown["deployment"]["mode"] == "static"
    # A finished study says why it finished, not what it was doing before.
    assert "confirming" not in shown["finish_reason"] and "confirmed" in shown["finish_reason"]

    r = cli(base, tokens["user"], "study", "best", "pays")
    assert r.returncode == 0, r.stderr
    args = shlex.split(r.stdout)
    assert args[args.index("--max-running-requests") + 1] == "160"
    assert args[args.index("--cuda-graph-max-bs-decode") + 1] == "128"
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--model-path") + 1] == placeholder("moe-pcie")

    # On a worker host, the registry of its config gives the real paths (relative to the file).
    cfg = tmp_path / "worker.toml"
    cfg.write_text('[models]\n"moe-pcie" = "/srv/models/moe"\n"moe-pcie-eagle3" = "eagle"\n')
    r = cli(base, tokens["user"], "study", "best", "pays", "--worker-config", str(cfg), "--host", "0.0.0.0")
    assert r.returncode == 0, r.stderr
    args = shlex.split(r.stdout)
    assert args[args.index("--model-path") + 1] == "/srv/models/moe"
    assert args[args.index("--speculative-draft-model-path") + 1] == str(tmp_path / "eagle")
    assert args[args.index("--host") + 1] == "0.0.0.0"
    cfg.write_text('[models]\n"other" = "/srv/x"\n')
    r = cli(base, tokens["user"], "study", "best", "pays", "--worker-config", str(cfg))
    assert r.returncode == 2 and "no [models] entry for moe-pcie" in r.stderr and "Traceback" not in r.stderr


def test_best_when_speculation_does_not_pay(server: tuple[str, dict[str, str]]) -> None:
    base, tokens = server
    spec = small_spec("slower", budget={"max_trials": 2}, confirmation={"top": 0})
    shown = run_fixed(base, tokens, spec, 80.0)
    assert shown["verdict"].startswith("speculation does not pay here")
    assert shown["speculation_pays"] is False and shown["deployment"]["mode"] == "no_speculation"

    r = cli(base, tokens["user"], "study", "best", "slower")
    assert r.returncode == EXIT_NO_SPECULATION == 3
    assert r.stdout.startswith("python -m sglang.launch_server ")
    assert "--speculative" not in r.stdout and "--max-running-requests" not in r.stdout
    assert "speculation does not pay here" in r.stderr
    r = cli(base, tokens["user"], "study", "best", "slower", "--format", "json")
    assert r.returncode == 3 and '"speculation_pays": false' in r.stdout
