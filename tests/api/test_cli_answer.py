"""`spectune study best` hands over what to deploy: sized by `serving`, and without speculation when it does not pay."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.cli import EXIT_CANNOT_TELL_APART, EXIT_NO_ANSWER, EXIT_NO_SPECULATION, EXIT_PAYS
from optimizer.deploy import placeholder
from tests.api.test_cli_study import cli
from tests.support.specs import INVENTORY, small_spec

pytestmark = pytest.mark.slow


def level(c: int, tok_s: float, spread: float = 0.005, saturated: str | None = None) -> dict[str, Any]:
    runs = [tok_s * (1 - spread), tok_s, tok_s * (1 + spread)]
    out: dict[str, Any] = {"concurrency": c, "output_tok_s": tok_s, "output_tok_s_runs": runs}
    return out if saturated is None else out | {"saturated": saturated}


def run_fixed(
    base: str,
    tokens: dict[str, str],
    spec: dict[str, Any],
    trial_tok_s: float,
    *,
    spread: float = 0.005,
    saturated: str | None = None,
) -> dict[str, Any]:
    """Every trial measures `trial_tok_s` (runs `spread` either side, marked `saturated` when
    given) against a 100 tok/s baseline at every level; returns the finished study."""
    h = {role: {"Authorization": f"Bearer {t}"} for role, t in tokens.items()}
    levels = spec["workload"]["concurrency"]
    with httpx.Client(base_url=base, timeout=30) as c:
        assert c.post("/v1/studies", headers=h["user"], json=spec).status_code == 201
        for _ in range(40):  # bounded; the budget ends the study well before
            r = c.post("/v1/workers/w1/lease", headers=h["worker"], json=INVENTORY)
            if r.status_code == 204:
                break
            lease = r.json()
            if lease["kind"] == "baseline":
                measured = [level(x, 100.0) for x in levels]
            else:
                measured = [level(x, trial_tok_s, spread, saturated) for x in levels]
            body = {"outcome": "ok", "metrics": {"levels": measured, "sglang_version": "0.5.23"}}
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
    # Resuming it says that it finished, why, and how to search further (not "its budget is used").
    r = cli(base, tokens["user"], "study", "resume", "pays")
    assert r.returncode == 2 and r.stderr.startswith("error: 409: study 'pays' "), r.stderr
    assert shown["finish_reason"] in r.stderr and "create a new study of the same model with " in r.stderr

    r = cli(base, tokens["user"], "study", "best", "pays")
    assert r.returncode == EXIT_PAYS == 0, r.stderr
    assert r.stderr.startswith("# pays: speculation pays here") and "(exit 0)" in r.stderr.splitlines()[0]
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
    assert r.stderr.splitlines()[0] == "# " + _first_line(base, tokens, "slower").removeprefix("answer   ")
    assert r.stderr.startswith("# does not pay: speculation does not pay here")
    assert r.stdout.startswith("python -m sglang.launch_server ")
    assert "--speculative" not in r.stdout and "--max-running-requests" not in r.stdout
    assert "speculation does not pay here" in r.stderr
    r = cli(base, tokens["user"], "study", "best", "slower", "--format", "json")
    assert r.returncode == 3 and '"speculation_pays": false' in r.stdout and '"outcome": "does_not_pay"' in r.stdout


def _first_line(base: str, tokens: dict[str, str], name: str) -> str:
    """The first line `spectune study show` prints (the outcome's headline)."""
    r = cli(base, tokens["user"], "study", "show", name)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()[0]


def test_best_cannot_tell_apart_a_gain_within_noise(server: tuple[str, dict[str, str]]) -> None:
    """1% above the baseline with runs 10% apart: neither "pays" nor "does not pay" (exit 5)."""
    base, tokens = server
    spec = small_spec("within-noise", budget={"max_trials": 2}, confirmation={"top": 0})
    shown = run_fixed(base, tokens, spec, 101.0, spread=0.1)
    assert shown["outcome"] == "cannot_tell_apart" and shown["deployment"]["mode"] == "no_speculation"
    first = _first_line(base, tokens, "within-noise")
    assert first.startswith("answer   cannot tell apart:") and first.endswith("(exit 5)")
    r = cli(base, tokens["user"], "study", "best", "within-noise")
    assert r.returncode == EXIT_CANNOT_TELL_APART == 5, r.stderr
    assert r.stderr.startswith("# cannot tell apart:") and "--speculative" not in r.stdout
    assert r.stdout.startswith("python -m sglang.launch_server ")


def test_best_says_no_answer_for_a_saturated_or_unmeasured_study(server: tuple[str, dict[str, str]]) -> None:
    """A study whose measurements saturated the host, or that measured nothing, is no answer
    (exit 4, no command on stdout), never "does not pay" (exit 3)."""
    base, tokens = server
    spec = small_spec("saturated", budget={"max_trials": 2}, confirmation={"top": 0})
    shown = run_fixed(base, tokens, spec, 80.0, saturated="the load generator fell behind its schedule")
    assert shown["outcome"] == "no_answer" and shown["verdict"].startswith("no answer")
    first = _first_line(base, tokens, "saturated")
    assert first.startswith("answer   no answer: the answer's measurement saturated") and first.endswith("(exit 4)")
    r = cli(base, tokens["user"], "study", "best", "saturated")
    assert r.returncode == EXIT_NO_ANSWER == 4, r.stderr
    assert r.stderr.startswith("# no answer:") and r.stdout == ""
    assert "does not pay" not in r.stderr.splitlines()[0]

    # Stopped before anything was measured: no answer too, said the same way.
    h = {"Authorization": f"Bearer {tokens['user']}"}
    assert httpx.post(f"{base}/v1/studies", headers=h, json=small_spec("unmeasured"), timeout=30).status_code == 201
    r = cli(base, tokens["user"], "study", "best", "unmeasured", "--format", "json")
    assert r.returncode == 4 and '"outcome": "no_answer"' in r.stdout, r.stderr
    assert _first_line(base, tokens, "unmeasured") == "answer   no answer: nothing measured yet (exit 4)"
    assert cli(base, tokens["user"], "study", "stop", "unmeasured").returncode == 0
    assert _first_line(base, tokens, "unmeasured") == "answer   no answer: nothing measured (exit 4)"
    r = cli(base, tokens["user"], "study", "best", "unmeasured")
    assert r.returncode == 4 and r.stdout == "" and "nothing measured" in r.stderr
