"""Prometheus `/metrics`: a token is needed; leases, expiries, trials, failures and route latency."""

from __future__ import annotations

import time
from typing import Any

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.api.test_report import report_spec, run_simulated_study
from tests.support.api_client import Api, make_settings, make_tokens
from tests.support.specs import INVENTORY


def scrape(api: Api) -> dict[str, list[tuple[dict[str, str], float]]]:
    r = api.get("/metrics", "user")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for lb, v in samples.get(name, []) if all(lb.get(k) == want for k, want in labels.items()))


def test_metrics_need_a_token_and_count_what_happened(api: Api) -> None:
    assert api.client.get("/metrics").status_code == 401
    assert api.get("/metrics", "worker").status_code == 403  # a worker token leases and reports, nothing else
    assert api.get("/metrics", "admin").status_code == 200
    shown = run_simulated_study(api.client, api.tokens, report_spec("m", max_trials=8, concurrency=(1,)))
    trials = api.get("/v1/studies/m/trials", "user").json()
    m = scrape(api)

    assert value(m, "spectune_leases_issued_total", kind="baseline") >= 1
    assert value(m, "spectune_leases_issued_total", kind="trial") == shown["configurations_launched"]
    assert value(m, "spectune_leases", kind="trial", state="completed") >= 1
    assert value(m, "spectune_studies", state="finished") == 1
    assert value(m, "spectune_trials", study="m", state="COMPLETE") == len(trials)
    ooms = sum(1 for t in trials if t["failure_kind"] == "oom" and t["duplicate_of"] is None)
    assert ooms >= 1 and value(m, "spectune_lease_failures", study="m", kind="oom") >= ooms
    assert value(m, "spectune_leases_expired_total") == 0
    # Latency by route template (never by raw path), lease and complete included.
    lease_count = value(m, "spectune_http_request_duration_seconds_count", route="/v1/workers/{worker_id}/lease")
    complete_count = value(m, "spectune_http_request_duration_seconds_count", route="/v1/leases/{lease_id}/complete")
    issued = value(m, "spectune_leases_issued_total")
    assert lease_count >= issued and complete_count == issued  # every lease handed out was reported once
    assert not any("sim-1" in lb.get("route", "") for lb, _ in m["spectune_http_request_duration_seconds_count"])
    assert value(m, "spectune_http_request_duration_seconds_count", route="/metrics", status="401") == 1


def test_an_expired_lease_is_counted(db_url: str) -> None:
    from api.app import create_app

    tokens = make_tokens(db_url)
    with TestClient(create_app(make_settings(db_url, lease_ttl_s=1.0))) as client:
        api = Api(client, tokens)
        api.post("/v1/studies", "user", report_spec("exp", max_trials=4, concurrency=(1,)))
        silent: dict[str, Any] = api.post("/v1/workers/w-silent/lease", "worker", INVENTORY).json()
        assert silent["kind"] == "baseline"
        # The silent worker never heartbeats; any later lease call reclaims what is past due.
        deadline = time.monotonic() + 20
        while value(scrape(api), "spectune_leases_expired_total") < 1:
            assert time.monotonic() < deadline, "the lease was never reclaimed"
            time.sleep(0.3)
            api.post("/v1/workers/w-other/lease", "worker", INVENTORY)
        m = scrape(api)
        # w-other's own baseline may have expired meanwhile too (it never reports either).
        expired = value(m, "spectune_leases_expired_total")
        assert expired >= 1
        assert value(m, "spectune_leases", kind="baseline", state="expired") == expired
