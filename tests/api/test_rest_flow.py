"""The REST API end to end on both backends: study -> baseline lease -> trial lease -> results."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

from tests.support.api_client import Api
from tests.support.specs import INVENTORY, small_spec


def ok_metrics(tok_s: float, concurrency: int = 1, **extra: Any) -> dict[str, Any]:
    runs = [tok_s * 0.99, tok_s, tok_s * 1.01]
    level = {"concurrency": concurrency, "output_tok_s": tok_s, "output_tok_s_runs": runs, "itl_ms_p99": 12.0}
    return {"outcome": "ok", "metrics": {"levels": [level], "startup_s": 3.5, **extra}}


def lease(api: Api, worker: str = "w1", inventory: dict[str, Any] | None = None) -> Any:
    return api.post(f"/v1/workers/{worker}/lease", "worker", inventory or INVENTORY)


def test_healthz_is_open_and_docs_served(api: Api) -> None:
    assert api.client.get("/healthz").json() == {"status": "ok"}
    schema = api.client.get("/openapi.json").json()
    assert "/v1/workers/{worker_id}/lease" in schema["paths"]
    assert api.client.get("/docs").status_code == 200


def _untyped_objects(node: Any, schemas: dict[str, Any], path: str, seen: set[str]) -> list[str]:
    """Paths inside a JSON schema where an object may hold anything (a bare `additionalProperties: true`,
    or an object with no properties and no schema for its values); `$ref`s are followed once each."""
    found: list[str] = []
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            name = ref.rsplit("/", 1)[-1]
            if name not in seen:
                seen.add(name)
                found += _untyped_objects(schemas[name], schemas, f"{path}->{name}", seen)
        if node.get("additionalProperties") is True or (
            node.get("type") == "object"
            and not {"properties", "additionalProperties", "patternProperties"} & node.keys()
        ):
            found.append(path)
        for key, value in node.items():
            found += _untyped_objects(value, schemas, f"{path}/{key}", seen)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _untyped_objects(value, schemas, f"{path}[{i}]", seen)
    return found


def test_every_study_route_answers_a_typed_document(api: Api) -> None:
    schema = api.client.get("/openapi.json").json()
    schemas = schema["components"]["schemas"]
    routes = {p: ops for p, ops in schema["paths"].items() if p.startswith("/v1/studies")}
    assert len(routes) >= 4
    answers = 0
    for path, ops in routes.items():
        for method, op in ops.items():
            body = op["responses"]["201" if method == "post" and path == "/v1/studies" else "200"]
            content = body["content"]["application/json"]["schema"]
            assert content, f"{method.upper()} {path} documents no response schema"
            assert not _untyped_objects(content, schemas, f"{method.upper()} {path}", set())
            answers += 1
    assert answers >= 6
    assert "winner" in schemas["StudyDocument"]["properties"] and "Winner" in schemas and "TrialRow" in schemas
    # The check sees an untyped object where there is one (e.g. a `dict[str, Any]` field).
    assert _untyped_objects({"type": "object", "additionalProperties": True}, schemas, "probe", set()) == ["probe"]
    assert _untyped_objects({"type": "object"}, schemas, "probe", set()) == ["probe"]


def test_rest_session_end_to_end(api: Api, db_url: str) -> None:
    r = api.post("/v1/studies", "user", small_spec("e2e"))
    assert r.status_code == 201, r.text
    assert r.json()["state"] == "running"

    # A worker without a baseline for this study measures the baseline first.
    r = lease(api)
    assert r.status_code == 200, r.text
    base = r.json()
    assert base["kind"] == "baseline" and base["trial_number"] is None
    assert base["server"]["speculative"] is None
    assert base["server"]["attention_backend"] == "fa3"
    assert base["server"]["max_running_requests"] >= 1

    # Asking again while holding the lease returns the same lease.
    again = lease(api).json()
    assert again["lease_id"] == base["lease_id"]

    r = api.post(f"/v1/leases/{base['lease_id']}/heartbeat", "worker")
    assert r.status_code == 200
    r = api.post(f"/v1/leases/{base['lease_id']}/complete", "worker", ok_metrics(90.0))
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "completed"

    # Now a trial: the warm start (SGLang's default 3/1/4) comes first.
    r = lease(api)
    assert r.status_code == 200, r.text
    trial = r.json()
    assert trial["kind"] == "trial"
    assert trial["config"] == {"num_steps": 3, "topk": 1, "num_draft_tokens": 4, "cuda_graph_max_bs": None}
    assert trial["server"]["speculative"]["num_steps"] == 3
    assert trial["server"]["draft"] == "moe-pcie-eagle3"
    r = api.post(
        f"/v1/leases/{trial['lease_id']}/complete",
        "worker",
        ok_metrics(94.5, effective={"speculative_num_draft_tokens": 4}, sglang_version="0.5.23"),
    )
    assert r.status_code == 200, r.text
    assert abs(r.json()["speedup"] - 94.5 / 90.0) < 1e-9

    shown = api.get("/v1/studies/e2e", "user").json()
    assert shown["trials"]["COMPLETE"] == 1
    assert shown["best"]["trial_number"] == trial["trial_number"]
    assert abs(shown["best"]["speedup"] - 1.05) < 1e-9
    iv = shown["best"]["speedup_interval_by_level"]["1"]
    assert iv["low"] < 1.05 < iv["high"] and iv["high"] - iv["low"] < 0.1
    cmd = shown["best"]["launch_command"]
    assert "--speculative-num-steps 3" in cmd and "--speculative-eagle-topk 1" in cmd
    # Deployed without a serving section: it admits only the load measured (concurrency 1), and says so.
    assert "--speculative-num-draft-tokens 4" in cmd and "--cuda-graph-max-bs-decode 1" in cmd
    assert "--max-running-requests 1 " in cmd + " "
    assert "at most 1 running request," in shown["deployment"]["load_note"]  # one request, said in the singular
    assert shown["deployment"]["load_line"] == "proven at concurrency 1; admits at most 1 running request"

    trials = api.get("/v1/studies/e2e/trials", "user").json()
    done = [t for t in trials if t["state"] == "COMPLETE"]
    assert done[0]["effective"] == {"speculative_num_draft_tokens": 4}

    # A separate process sees the trial through Optuna's own API.
    code = textwrap.dedent(
        f"""
        import json, optuna
        s = optuna.load_study(storage={db_url!r}, study_name="e2e")
        t = [t for t in s.trials if t.state.name == "COMPLETE"][0]
        print(json.dumps({{"params": t.params, "value": t.value, "metric_names": s.metric_names}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["params"] == {"num_steps": 3, "topk": 1}
    assert abs(seen["value"] - 94.5 / 90.0) < 1e-9
    assert seen["metric_names"] == ["speedup"]


def test_complete_twice_records_one_result(api: Api) -> None:
    api.post("/v1/studies", "user", small_spec("twice"))
    b = lease(api).json()
    api.post(f"/v1/leases/{b['lease_id']}/complete", "worker", ok_metrics(100.0))
    t = lease(api).json()
    first = api.post(f"/v1/leases/{t['lease_id']}/complete", "worker", ok_metrics(120.0))
    second = api.post(f"/v1/leases/{t['lease_id']}/complete", "worker", ok_metrics(50.0))
    assert first.status_code == second.status_code == 200
    assert second.json()["duplicate"] is True
    assert second.json()["speedup"] == first.json()["speedup"] == 1.2
    trials = api.get("/v1/studies/twice/trials", "user").json()
    assert [t["speedup"] for t in trials if t["state"] == "COMPLETE"] == [1.2]


def test_oom_is_taught_as_infeasible_not_as_a_value(api: Api) -> None:
    api.post("/v1/studies", "user", small_spec("oom"))
    b = lease(api).json()
    api.post(f"/v1/leases/{b['lease_id']}/complete", "worker", ok_metrics(100.0))
    t1 = lease(api).json()
    api.post(f"/v1/leases/{t1['lease_id']}/complete", "worker", ok_metrics(80.0))
    t2 = lease(api).json()
    fail = {"outcome": "failed", "failure": {"kind": "oom", "message": "CUDA out of memory", "log_tail": "..."}}
    r = api.post(f"/v1/leases/{t2['lease_id']}/complete", "worker", fail)
    assert r.status_code == 200, r.text
    trials = {t["number"]: t for t in api.get("/v1/studies/oom/trials", "user").json()}
    told = trials[t2["trial_number"]]
    assert told["state"] == "COMPLETE" and told["feasible"] is False
    assert told["failure_kind"] == "oom"
    # The placeholder is the worst speedup seen, never a flattering one.
    assert told["speedup"] == 0.8
    shown = api.get("/v1/studies/oom", "user").json()
    assert shown["best"]["trial_number"] == t1["trial_number"]


def test_host_fault_is_retried_on_another_worker_not_taught(api: Api) -> None:
    api.post("/v1/studies", "user", small_spec("retry"))
    for w in ("w1", "w2"):
        b = lease(api, w).json()
        api.post(f"/v1/leases/{b['lease_id']}/complete", "worker", ok_metrics(100.0))
    t = lease(api, "w1").json()
    crash = {"outcome": "failed", "failure": {"kind": "crash", "message": "segfault", "log_tail": ""}}
    api.post(f"/v1/leases/{t['lease_id']}/complete", "worker", crash)
    again = lease(api, "w2").json()
    assert again["trial_number"] == t["trial_number"] and again["attempt"] == 2
    assert again["config"] == t["config"]
    workers = {w["id"]: w for w in api.get("/v1/workers", "user").json()}
    assert workers["w1"]["recent_failures"][0]["kind"] == "crash"
    assert workers["w2"]["current_lease"]["lease_id"] == again["lease_id"]
