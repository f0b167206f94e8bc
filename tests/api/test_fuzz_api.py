"""API fuzzing: schemathesis against a real `spectune server` on Postgres, with valid tokens.

Every operation in the app's OpenAPI schema gets generated requests, valid ones (positive) and
invalid ones (negative), with the right token for it: a worker token for the lease protocol, an
admin token for admin operations, a user token for the rest.  Lease operations are pointed at a
live lease of a real study about half of the time, so the complete and progress paths see
arbitrary reports, not only 404s.  The checks: no 5xx, and every documented response matches its
schema.  Examples are bounded and derandomized so the run is fast and repeatable; widen with
SPECTUNE_FUZZ_EXAMPLES for a longer hunt.

Body and spec limits are checked directly: over `SPECTUNE_MAX_BODY_BYTES` is 413, a spec that
fits the body limit but not the field limits is 422; neither is ever a 5xx.
"""

from __future__ import annotations

import json
import os
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.api_client import make_tokens
from tests.support.db import pg_clone
from tests.support.helpers import api_server
from tests.support.specs import INVENTORY, set_path, small_spec

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis: make setup installs it (the dev extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (after the importorskip)
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error, response_schema_conformance  # noqa: E402

pytestmark = [pytest.mark.postgres]

EXAMPLES = int(os.environ.get("SPECTUNE_FUZZ_EXAMPLES", "12"))
MAX_BODY = 64 * 1024


@dataclass
class Target:
    url: str
    tokens: dict[str, str]

    def headers(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    def live_lease(self) -> str | None:
        # A worker of its own: what the fuzzer reported as w1 (e.g. a refusal, after which w1 is
        # not offered the study again) must not decide whether there is work.
        worker = f"w-{uuid.uuid4().hex[:8]}"
        r = httpx.post(
            f"{self.url}/v1/workers/{worker}/lease", json=INVENTORY, headers=self.headers("worker"), timeout=30
        )
        assert r.status_code in (200, 204), r.text
        return None if r.status_code == 204 else str(r.json()["lease_id"])


@pytest.fixture(scope="module")
def fuzz_db(pg_template: str) -> Iterator[str]:
    """One database for the module: the server is started once (tests only add studies)."""
    with pg_clone(pg_template, "spectune_fuzz") as url:
        yield url


@pytest.fixture(scope="module")
def target(fuzz_db: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    tokens = make_tokens(fuzz_db)
    tmp_path = tmp_path_factory.mktemp("fuzz")
    env = {"SPECTUNE_MAX_BODY_BYTES": str(MAX_BODY), "SPECTUNE_HEARTBEAT_INTERVAL_S": "1"}
    with api_server(fuzz_db, log_path=tmp_path / "api.log", env=env) as url:
        t = Target(url, tokens)
        r = httpx.post(f"{url}/v1/studies", json=small_spec("fuzz"), headers=t.headers("user"), timeout=30)
        assert r.status_code == 201, r.text
        yield t
        log = (tmp_path / "api.log").read_text(errors="replace")
        # Nothing the fuzzer sent may have crashed a request handler.
        assert "Traceback" not in log, log[-4000:]
        for token in tokens.values():
            assert token not in log


def _naive(value: Any) -> bool:
    return isinstance(value, str) and len(value) >= 19 and value[10] == "T" and not value.endswith(("Z", "+00:00"))


def _role(method: str, path: str, tags: list[str]) -> str:
    if "leases" in tags:
        return "worker"
    if path.endswith("/release"):
        return "admin"
    return "user"


def _check(case: Any, target: Target, headers: dict[str, str], *, use_live_lease: bool) -> None:
    """Send one generated request and check the answer."""
    params = case.path_parameters
    if use_live_lease and params is not None:
        # About half of the lease calls go to a real live lease (chosen from the body, so the
        # choice is the same on every run), the rest to whatever id was generated.
        if "lease_id" in params and zlib.crc32(json.dumps(case.body, default=str).encode()) % 2 == 0:
            lease_id = target.live_lease()
            if lease_id is not None:
                params["lease_id"] = lease_id
        if "worker_id" in params:
            params["worker_id"] = "w1"
    response = case.call(base_url=target.url, headers=headers, timeout=60)
    case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])


def _fuzz(op: Any, mode: GenerationMode, target: Target, headers: dict[str, str]) -> None:
    live = mode is GenerationMode.POSITIVE and ("lease_id" in op.path or op.path.endswith("/lease"))

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    def run(case: Any) -> None:
        _check(case, target, headers, use_live_lease=live)

    try:
        run()
    except Unsatisfiable:
        # An operation without inputs (GET /v1/studies) has no invalid request to make.
        if mode is not GenerationMode.NEGATIVE:
            raise


def test_schemathesis_finds_no_server_error_and_no_schema_violation(target: Target) -> None:
    schema = schemathesis.openapi.from_url(f"{target.url}/openapi.json")
    ran: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        tags = list(op.definition.raw.get("tags", []))
        headers = target.headers(_role(op.method.upper(), op.path, tags))
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(op, mode, target, headers)
        ran.append(f"{op.method.upper()} {op.path}")
    # The schema really was exercised: every API family was reached.
    assert any("/v1/studies" in r for r in ran) and any("/complete" in r for r in ran), ran
    assert len(ran) >= 11, ran


def test_lease_deadlines_are_rfc3339_date_times(target: Target) -> None:
    lease_id = target.live_lease()
    assert lease_id is not None
    r = httpx.post(f"{target.url}/v1/leases/{lease_id}/heartbeat", headers=target.headers("worker"), timeout=30)
    assert r.status_code == 200, r.text
    assert not _naive(r.json()["deadline"]), r.json()


def test_422_responses_match_the_documented_schema(target: Target) -> None:
    schema = schemathesis.openapi.from_url(f"{target.url}/openapi.json")
    op = schema["/v1/studies"]["POST"]
    case = op.Case(body={"name": "BAD NAME", "model": {"target": "a", "draft": "b"}})
    response = case.call(base_url=target.url, headers=target.headers("user"), timeout=30)
    assert response.status_code == 422
    case.validate_response(response, checks=[response_schema_conformance])


def test_bodies_over_the_limit_are_413_before_parsing(target: Target) -> None:
    big = b'{"name": "' + b"x" * (MAX_BODY + 1) + b'"}'
    for path, role in (
        ("/v1/studies", "user"),
        ("/v1/workers/w1/lease", "worker"),
        ("/v1/leases/x/complete", "worker"),
    ):
        r = httpx.post(
            f"{target.url}{path}",
            content=big,
            headers={**target.headers(role), "Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 413, (path, r.status_code, r.text[:200])
        assert r.json()["error"]["code"] == "payload_too_large"
    # Unauthenticated: refused just the same, and the body is never parsed.
    r = httpx.post(f"{target.url}/v1/studies", content=big, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413


def test_a_chunked_body_over_the_limit_is_refused_too(target: Target) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"name": "'
        for _ in range(8):
            yield b"x" * MAX_BODY
        yield b'"}'

    # No Content-Length: httpx sends Transfer-Encoding: chunked for a generator body.
    r = httpx.post(
        f"{target.url}/v1/studies",
        content=chunks(),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413, r.status_code


def _spec_with(**over: Any) -> dict[str, Any]:
    spec = small_spec("limits")
    for path, value in over.items():
        set_path(spec, path, value, sep="__")
    return spec


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"name": "n" * 5000}, "name"),
        ({"model__target": "m" * 5000}, "model.target"),
        ({"workload__concurrency": list(range(1, 5000))}, "workload.concurrency"),
        ({"workload__num_prompts": 10**12}, "workload.num_prompts"),
        ({"budget__max_trials": 10**9}, "budget.max_trials"),
        ({"search_space__topk": list(range(1, 3000))}, "search_space"),
        ({"model__extra_args": {f"--f{i}": True for i in range(2000)}}, "model.extra_args"),
        ({"warm_start": [{"num_steps": 3, "topk": 1, "num_draft_tokens": 4}] * 3000}, "warm_start"),
    ],
)
def test_oversized_specs_are_refused_with_422_never_a_crash(target: Target, over: dict[str, Any], field: str) -> None:
    body = _spec_with(**over)
    r = httpx.post(f"{target.url}/v1/studies", json=body, headers=target.headers("user"), timeout=60)
    size = len(json.dumps(body))
    expected = 413 if size > MAX_BODY else 422
    assert r.status_code == expected, (field, size, r.status_code, r.text[:300])
    if expected == 422:
        assert r.json()["error"]["field"].startswith(field.split(".")[0]), r.text[:300]


def test_a_placement_no_worker_can_match_is_accepted_without_harm(target: Target) -> None:
    # Workers send at most 64 labels (spectune_protocol.Inventory), so this study can never run; the
    # spec does not bound placement (optimizer/spec.py, reported).  It must at least not crash.
    body = _spec_with(name="wide-placement", placement={f"k{i}": "v" * 100 for i in range(500)})
    r = httpx.post(f"{target.url}/v1/studies", json=body, headers=target.headers("user"), timeout=60)
    assert r.status_code in (201, 422), r.text[:300]
