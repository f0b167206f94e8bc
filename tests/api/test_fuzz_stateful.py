"""Stateful fuzzing: generated studies, leases and reports against a real server on Postgres.

A hypothesis rule-based state machine plays users and workers at once against one `spectune
server` subprocess: it creates studies from generated specs (mostly sound, often with a value
the code cannot use: seed 5000 or -5, max_hours 1e300 or Infinity, NaN latency limits and flag
values, thousands of concurrency levels, names ending in a newline), leases work for a few
workers, heartbeats, reports progress and completes with generated metrics (sound ones, and
NaN, Infinity, zero, huge, too many or too few levels, `effective` nested 300 deep), refuses
leases the way a worker does, and reads back studies, trials, the HTML report and the
dashboard's API.  Checked on every step:

* no 5xx anywhere, and every error answer has the documented shape;
* every lease handed out parses with the worker's own protocol model (a lease a worker cannot
  read is a lease it can only refuse);
* no lease is handed out again after it was completed or refused;

and at the end of every example: every study it created can be stopped (or has finished), and
its report renders.

Each example uses its own model and worker names, so studies of earlier examples (all stopped
by then) never hand work to later ones.  The example count is CI-sized and derandomized; widen it
with SPECTUNE_FUZZ_STATEFUL_EXAMPLES for a longer hunt.
"""

from __future__ import annotations

import itertools
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, precondition, rule, run_state_machine_as_test

from spectune_protocol import LeaseOut
from tests.support.api_client import make_tokens
from tests.support.db import pg_clone
from tests.support.helpers import api_server

pytestmark = [pytest.mark.postgres]

EXAMPLES = int(os.environ.get("SPECTUNE_FUZZ_STATEFUL_EXAMPLES", "8"))
STEPS = int(os.environ.get("SPECTUNE_FUZZ_STATEFUL_STEPS", "30"))
_example_ids = itertools.count()

# ----------------------------------------------------------------------------- strategies

NAN, INF = float("nan"), float("inf")
# Numbers that broke the API once (seed * 1,000,003 over 2**32 - 1; timedelta overflow) and
# their neighbours on both sides of every limit.
seeds = st.one_of(
    st.none(), st.sampled_from([5000, -5, 0, 7, 4294, 4295, 2**32 - 1, 2**32]), st.integers(-(2**40), 2**40)
)
hours = st.one_of(st.none(), st.sampled_from([1e300, INF, NAN, -1.0, 0.0, 1e-9, 0.5, 100_000.0, 100_001.0]))
limits = st.one_of(st.none(), st.sampled_from([10.0, 250.0, INF, NAN, -1.0, 1e300, 0.0]))
extra_args = st.sampled_from(
    [
        {},
        {"--schedule-conservativeness": NAN},
        {"--schedule-conservativeness": INF},
        {"--schedule-conservativeness": 0.5},
        {"--dtype": "bfloat16"},
        {"--dtype": "bfloat16\n"},
        {"--chunked-prefill-size": 10**40},
        {"--chunked-prefill-size": 4096},
        {"--disable-radix-cache": True},
    ]
)
level_lists = st.one_of(
    st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=3, unique=True),
    st.sampled_from([list(range(1, 65)), list(range(1, 66)), list(range(1, 4097)), [], [0], [5000]]),
)
name_tails = st.sampled_from(["", "", "", "\n", "X", "/x"])


@st.composite
def specs(draw: st.DrawFn, example: int) -> dict[str, Any]:
    names = f"fz{example}"
    spec: dict[str, Any] = {
        "name": f"{names}-{uuid.uuid4().hex[:6]}{draw(name_tails)}",
        "model": {
            "target": f"{names}-target" + draw(st.sampled_from(["", "", "", "\n"])),
            "draft": f"{names}-draft",
            "extra_args": draw(extra_args),
        },
        "search_space": {"num_steps": {"low": 1, "high": 4}, "topk": [1, 2], "num_draft_tokens": {"low": 2, "high": 8}},
        "workload": {
            "output_len": 16,
            "num_prompts": 2,
            "repeats": 1,
            "warmup_requests": 0,
            "concurrency": draw(level_lists),
            "prompts": draw(st.sampled_from(["builtin:chat", "builtin:chat", "p.jsonl", "p.jsonl\n"])),
        },
        "budget": {
            "max_trials": draw(st.integers(1, 4)),
            "max_hours": draw(hours),
            "patience": draw(st.one_of(st.none(), st.integers(1, 3), st.just(10**30))),
        },
        "objective": {"max_p99_itl_ms": draw(limits), "max_p99_ttft_ms": draw(limits)},
        "sampler": draw(st.sampled_from(["auto", "tpe", "random", "grid"])),
        "seed": draw(seeds),
        "confirmation": {"top": draw(st.integers(0, 2))},
    }
    # Drop the None values: a spec leaves out what it does not set.
    for section in ("budget", "objective"):
        spec[section] = {k: v for k, v in spec[section].items() if v is not None}
    if spec["seed"] is None:
        del spec["seed"]
    return spec


# What a hostile (or careless) user puts in a spec (issue 18): spaces too large to enumerate,
# values beyond what the code accepts, option-like words that would read as another flag.
HOSTILE_SPEC_CHANGES: list[tuple[str, Any]] = [
    ("search_space", {"num_steps": {"low": 1, "high": 4}, "topk": [1, 2], "num_draft_tokens": {"low": 2, "high": 2000}}),
    ("search_space", {"num_steps": {"low": 1, "high": 64}, "topk": list(range(1, 65)),
                      "num_draft_tokens": {"low": 2, "high": 1024}, "cuda_graph_max_bs": list(range(1, 65))}),
    ("search_space", {"num_steps": {"low": 4, "high": 1}, "topk": [], "num_draft_tokens": {"low": -5, "high": 8}}),
    ("model.extra_args", {"--dtype": "--host"}),
    ("model.extra_args", {"--dtype": "--host=0.0.0.0"}),
    ("model.extra_args", {"--model-path": "/etc"}),
    ("model.extra_args", {"--dtype": "-x"}),
    ("model.extra_args", {"--dtype": "bogus"}),
    ("model.mem_fraction_static", 0.01),
    ("model.mem_fraction_static", NAN),
    ("model.tp_size", 0),
    ("model.tp_size", 10**9),
    ("model.page_size", 2**63),
    ("workload.num_prompts", 10**9),
    ("workload.output_len", 0),
    ("workload.repeats", 10**6),
    ("budget.max_trials", 10**9),
    ("placement", {f"label{i}": "x" for i in range(500)}),
    ("placement", {"rack": "r1\nforged"}),
]  # fmt: skip


def hostile(spec: dict[str, Any], change: tuple[str, Any]) -> dict[str, Any]:
    where, value = change
    *path, key = where.split(".")
    node = spec
    for part in path:
        node = node.setdefault(part, {})
    node[key] = value
    return spec


wild_tok_s = st.sampled_from([0.0, -1.0, NAN, INF, 1e300, 5e-324, 1e-3, 1e9])
sound_tok_s = st.floats(min_value=1.0, max_value=5000.0)


def _deep(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"leaf": 1}
    for _ in range(depth):
        node = {"x": node}
    return node


effective = st.one_of(
    st.just({"speculative_num_steps": 3, "model_path": "/srv/models/x"}),
    st.sampled_from([2, 15, 300]).map(_deep),
    st.just({"v": [1.0, NAN]}),
    st.just({"v": 10**40}),
)


@st.composite
def reports(draw: st.DrawFn, levels: list[int]) -> dict[str, Any]:
    """A complete body for a lease whose workload has `levels`: mostly sound, sometimes not."""
    if draw(st.integers(0, 9)) == 0:
        kind = draw(st.sampled_from(["oom", "crash", "invalid_config", "benchmark_error", "lost"]))
        failure = {"kind": kind, "message": "fuzz", "host_fault": draw(st.booleans())}
        return {"outcome": "failed", "failure": failure}
    wild = draw(st.integers(0, 3)) == 0
    chosen = list(levels)
    if wild and draw(st.booleans()):
        chosen = draw(st.sampled_from([chosen[:1], chosen + [999], chosen + chosen[:1], [*range(1, 66)]]))
    body_levels = []
    for c in chosen:
        tok_s = draw(wild_tok_s if wild else sound_tok_s)
        level: dict[str, Any] = {
            "concurrency": c,
            "output_tok_s": tok_s,
            "output_tok_s_runs": [tok_s, draw(wild_tok_s if wild else sound_tok_s)],
            "itl_ms_p99": draw(st.sampled_from([5.0, 20.0, NAN, INF]) if wild else st.sampled_from([5.0, 20.0])),
            "accept_length": 2.0,
        }
        body_levels.append(level)
    metrics: dict[str, Any] = {"levels": body_levels, "startup_s": 1.0, "log_tail": "model_path='/srv/models/x'\n"}
    if draw(st.booleans()):
        metrics["effective"] = draw(effective) if wild else {"speculative_num_steps": 3}
    return {"outcome": "ok", "metrics": metrics}


FAR = b".99999999999."  # an expiry in the year 5138: only the id can be wrong
BAD_COOKIES = [
    b"9" * 26 + FAR + b"ff",
    b"9223372036854775808" + FAR + b"ff",
    b"1" * 5000 + FAR + b"ff",
    b"\xb2" + FAR + b"ff",  # latin-1 superscript two: str.isdigit() says yes, int() says no
    "\u0661".encode() + FAR + b"ff",  # an Arabic-Indic digit, as UTF-8
    b"9" * 26,
    b"a.b",
]

progress_bodies = st.fixed_dictionaries(
    {
        "step": st.integers(0, 3),
        "concurrency": st.sampled_from([1, 2, 4, 8, 0, 10**9]),
        "output_tok_s": st.one_of(sound_tok_s, wild_tok_s),
    }
)

# ----------------------------------------------------------------------------- the machine


class Server:
    url: str = ""
    # admin, user, worker, and "impostor": a second worker token, as a stolen one would be.
    tokens: dict[str, str] = {}


def _send(client: httpx.Client, method: str, path: str, token: str | None, body: Any = None) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    # NaN and Infinity go out as JSON's non-standard words, as a careless client would send them.
    content = None if body is None else json.dumps(body, allow_nan=True)
    r = client.request(method, path, content=content, headers=headers)
    assert r.status_code < 500, f"{method} {path}: {r.status_code} {r.text[:500]}"
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        doc = r.json()
        assert set(doc) == {"error", "detail"} and "code" in doc["error"], f"{method} {path}: {r.text[:300]}"
    return r


class LeaseFuzz(RuleBasedStateMachine):
    studies = Bundle("studies")
    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.example = next(_example_ids)
        self.client = httpx.Client(base_url=Server.url, timeout=60)
        self.created: list[str] = []
        self.closed: set[str] = set()
        self.workers = [f"fz{self.example}-w{i}" for i in range(2)]
        models = [f"fz{self.example}-target", f"fz{self.example}-draft"]
        self.inventory = {"hostname": "fuzz", "sglang_version": "0.5.23", "models": models}
        # Leases handed to this example's workers and not yet ended: the impostor must never get one.
        self.live: set[str] = set()
        self.impostor_id = f"fz{self.example}-imp"
        # The workers' ids are bound to the worker token by its first lease (nothing to do yet:
        # 204), so the impostor meets ids that are taken, as it would on a real fleet.
        for worker_id in self.workers:
            r = self.call("POST", f"/v1/workers/{worker_id}/lease", "worker", self.inventory)
            assert r.status_code == 204, r.text[:300]

    def call(self, method: str, path: str, role: str | None, body: Any = None) -> httpx.Response:
        return _send(self.client, method, path, None if role is None else Server.tokens[role], body)

    # -------------------------------------------------------------- users

    @rule(target=studies, spec=st.data())
    def create_study(self, spec: st.DataObject) -> str:
        body = spec.draw(specs(self.example))
        r = self.call("POST", "/v1/studies", "user", body)
        # 429: the token's running studies are at SPECTUNE_MAX_RUNNING_STUDIES_PER_USER.
        assert r.status_code in (201, 422, 429), r.text[:300]
        if r.status_code == 201:
            self.created.append(body["name"])
        return str(body["name"])

    @rule(target=studies, spec=st.data(), change=st.sampled_from(HOSTILE_SPEC_CHANGES))
    def create_hostile_study(self, spec: st.DataObject, change: tuple[str, Any]) -> str:
        """A spec a hostile user writes: refused (422, naming the field) or stored and harmless."""
        body = hostile(spec.draw(specs(self.example)), change)
        r = self.call("POST", "/v1/studies", "user", body)
        assert r.status_code in (201, 422, 429), r.text[:300]
        if r.status_code == 422:
            assert r.json()["error"]["message"], r.text[:300]
        if r.status_code == 201:
            self.created.append(body["name"])
        return str(body["name"])

    @rule(name=studies)
    def read_study(self, name: str) -> None:
        for path in (f"/v1/studies/{quote(name, safe='')}", f"/v1/studies/{quote(name, safe='')}/trials"):
            r = self.call("GET", path, "user")
            # A name with "/" never reaches the route (%2F is decoded): the dashboard says 403.
            assert r.status_code in (200, 404) or ("/" in name and r.status_code == 403), r.text[:300]

    @rule(name=consumes(studies))
    def stop_study(self, name: str) -> None:
        r = self.call("POST", f"/v1/studies/{quote(name, safe='')}/stop", "user")
        assert r.status_code in (200, 404, 409) or ("/" in name and r.status_code == 403), r.text[:300]

    @rule()
    def read_everything(self) -> None:
        assert self.call("GET", "/v1/studies", "user").status_code == 200
        assert self.call("GET", "/v1/workers", "user").status_code == 200
        r = self.call("GET", "/api/studies", "user")
        assert r.status_code == 200
        for summary in r.json()["study_summaries"][-3:]:
            assert self.call("GET", f"/api/studies/{summary['study_id']}", "user").status_code == 200
        assert self.call("GET", "/metrics", "user").status_code == 200

    @rule(cookie=st.sampled_from(BAD_COOKIES))
    def anonymous_cookie(self, cookie: bytes) -> None:
        r = self.client.get("/api/studies", headers={"Cookie": b"spectune_session=" + cookie})  # type: ignore[dict-item]
        assert r.status_code == 401, r.text[:200]

    @rule(path=st.sampled_from(["/favicon.ico", "/static/bundle.js"]))
    def static_without_accept_encoding(self, path: str) -> None:
        request = self.client.build_request("GET", path, headers={"Authorization": f"Bearer {Server.tokens['user']}"})
        del request.headers["accept-encoding"]
        r = self.client.send(request)
        assert r.status_code == 200, (path, r.status_code)

    # -------------------------------------------------------------- workers

    @rule(target=held, worker=st.integers(0, 1))
    def lease(self, worker: int) -> Any:
        worker_id = self.workers[worker]
        r = self.call("POST", f"/v1/workers/{worker_id}/lease", "worker", self.inventory)
        assert r.status_code in (200, 204), r.text[:300]
        if r.status_code == 204:
            return None
        doc = r.json()
        assert doc["lease_id"] not in self.closed, f"lease {doc['lease_id']} handed out again after it ended"
        self.live.add(doc["lease_id"])
        try:
            LeaseOut.model_validate(doc)  # what the worker does first with every lease
        except ValueError as e:
            raise AssertionError(f"a lease the worker cannot read: {e}\n{json.dumps(doc)[:600]}") from e
        return doc

    @rule(lease=held)
    def heartbeat(self, lease: Any) -> None:
        if lease is None:
            return
        r = self.call("POST", f"/v1/leases/{lease['lease_id']}/heartbeat", "worker")
        assert r.status_code in (200, 409, 410), r.text[:300]

    @rule(lease=held, body=progress_bodies)
    def progress(self, lease: Any, body: dict[str, Any]) -> None:
        if lease is None:
            return
        r = self.call("POST", f"/v1/leases/{lease['lease_id']}/progress", "worker", body)
        assert r.status_code in (200, 409, 410, 422), r.text[:300]

    @rule(lease=held, data=st.data())
    def complete(self, lease: Any, data: st.DataObject) -> None:
        if lease is None:
            return
        body = data.draw(reports(lease["workload"]["concurrency"]))
        r = self.call("POST", f"/v1/leases/{lease['lease_id']}/complete", "worker", body)
        assert r.status_code in (200, 409, 410, 422), r.text[:300]
        if r.status_code == 200:
            self.closed.add(lease["lease_id"])
            self.live.discard(lease["lease_id"])

    @rule(lease=consumes(held), kind=st.sampled_from(["refused", "invalid_config"]))
    def refuse(self, lease: Any, kind: str) -> None:
        """What a worker answers to a lease it will not run (a flag or model it does not allow)."""
        if lease is None:
            return
        failure = {"kind": kind, "message": "refused by this host", "host_fault": kind == "invalid_config"}
        r = self.call(
            "POST", f"/v1/leases/{lease['lease_id']}/complete", "worker", {"outcome": "failed", "failure": failure}
        )
        assert r.status_code in (200, 409, 410), r.text[:300]
        self.closed.add(lease["lease_id"])
        self.live.discard(lease["lease_id"])

    @precondition(lambda self: bool(self.created))
    @rule()
    def lease_until_no_work(self) -> None:
        """Drive one worker through sound reports for a while (bounded), as a real one would."""
        for _ in range(6):
            doc = self.lease(0)
            if doc is None:
                return
            levels = doc["workload"]["concurrency"]
            report = {
                "outcome": "ok",
                "metrics": {"levels": [{"concurrency": c, "output_tok_s": 100.0 + c} for c in levels]},
            }
            r = self.call("POST", f"/v1/leases/{doc['lease_id']}/complete", "worker", report)
            assert r.status_code == 200, r.text[:300]
            self.closed.add(doc["lease_id"])
            self.live.discard(doc["lease_id"])

    # -------------------------------------------------------------- a stolen worker token

    @rule(worker=st.integers(0, 1))
    def impostor_leases_as_another_worker(self, worker: int) -> None:
        """Another token asking as a bound worker id: refused, and the id's inventory kept."""
        inventory = {**self.inventory, "hostname": "impostor", "models": []}
        r = self.call("POST", f"/v1/workers/{self.workers[worker]}/lease", "impostor", inventory)
        assert r.status_code == 403, r.text[:300]

    @rule(lease=held, data=st.data())
    def impostor_acts_on_another_workers_lease(self, lease: Any, data: st.DataObject) -> None:
        """Heartbeat, progress and forged reports on a lease handed to another token: 404 (422
        for a body that fails the protocol), and the lease is untouched."""
        if lease is None:
            return
        lid = lease["lease_id"]
        for op, body in (
            ("heartbeat", None),
            ("progress", data.draw(progress_bodies)),
            ("complete", data.draw(reports(lease["workload"]["concurrency"]))),
            (
                "complete",
                {"outcome": "failed", "failure": {"kind": "refused", "message": "forged", "host_fault": False}},
            ),
            ("complete", {"outcome": "failed", "failure": {"kind": "crash", "message": "forged", "host_fault": True}}),
        ):
            r = self.call("POST", f"/v1/leases/{lid}/{op}", "impostor", body)
            assert r.status_code in (404, 422), (op, r.status_code, r.text[:300])
        if lid in self.live:
            # Its own worker can still act on it.
            r = self.call("POST", f"/v1/leases/{lid}/heartbeat", "worker")
            assert r.status_code in (200, 409, 410), r.text[:300]

    @rule(data=st.data())
    def impostor_works_as_itself(self, data: st.DataObject) -> None:
        """What a stolen token may do (lease as an id of its own, report what it likes) never
        hands it another worker's lease, and its wild reports are refused or contained."""
        r = self.call("POST", f"/v1/workers/{self.impostor_id}/lease", "impostor", self.inventory)
        assert r.status_code in (200, 204), r.text[:300]
        if r.status_code == 204:
            return
        doc = r.json()
        assert doc["lease_id"] not in self.live, "the impostor was handed a lease another worker holds"
        body = data.draw(reports(doc["workload"]["concurrency"]))
        r = self.call("POST", f"/v1/leases/{doc['lease_id']}/complete", "impostor", body)
        assert r.status_code in (200, 409, 410, 422), r.text[:300]
        if r.status_code != 200:
            # Refused: end it as a worker would, so it does not wait out its deadline.
            refusal = {"outcome": "failed", "failure": {"kind": "refused", "message": "fuzz", "host_fault": False}}
            r = self.call("POST", f"/v1/leases/{doc['lease_id']}/complete", "impostor", refusal)
            assert r.status_code in (200, 409, 410), r.text[:300]
        self.closed.add(doc["lease_id"])

    # -------------------------------------------------------------- the end of an example

    def teardown(self) -> None:
        from api.report import build_report, load_from_api

        try:
            user = httpx.Client(
                base_url=Server.url, timeout=60, headers={"Authorization": f"Bearer {Server.tokens['user']}"}
            )
            for name in self.created:
                # Every study can still be stopped (or has finished), and then reads back whole.
                path = f"/v1/studies/{quote(name, safe='')}"
                r = _send(self.client, "POST", f"{path}/stop", Server.tokens["user"])
                assert r.status_code in (200, 409), r.text[:300]
                shown = _send(self.client, "GET", path, Server.tokens["user"]).json()
                assert shown["state"] in ("stopped", "finished"), shown["state"]
                report = build_report(load_from_api(user, name))
                assert name in report.html
            user.close()
        finally:
            self.client.close()


# ----------------------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def fuzz_server(pg_template: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    log = tmp_path_factory.mktemp("stateful-fuzz") / "api.log"
    with pg_clone(pg_template, "spectune_sfuzz") as db_url:
        Server.tokens = make_tokens(db_url)
        Server.tokens["impostor"] = _make_worker_token(db_url, "fuzz-impostor")
        # No quarantine: the fuzzer's failure reports would soon park its two workers.
        env = {"SPECTUNE_QUARANTINE_AFTER": "100000", "SPECTUNE_MAX_BODY_BYTES": str(256 * 1024)}
        with api_server(db_url, log_path=log, env=env) as url:
            Server.url = url
            yield log


def _make_worker_token(url: str, name: str) -> str:
    from api.auth import create_token
    from api.db import make_engine, make_sessionmaker

    engine = make_engine(url)
    try:
        return create_token(make_sessionmaker(engine), "worker", name)[1]
    finally:
        engine.dispose()


def test_stateful_fuzz_never_breaks_a_study_or_the_fleet(fuzz_server: Path) -> None:
    run_state_machine_as_test(
        LeaseFuzz,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,
            derandomize=True,
            # No shrinking: each re-run costs real requests, and the failing step says enough.
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        ),
    )
    log = fuzz_server.read_text(errors="replace")
    # Nothing the fuzzer sent crashed a handler, and no token reached the log.
    assert "Traceback" not in log, log[-4000:]
    for token in Server.tokens.values():
        assert token not in log
