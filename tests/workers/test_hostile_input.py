"""Hostile input as the worker meets it (issues 13 and 18): a lease outside the protocol is never
worked on, a NaN heartbeat interval never beats, a lease's text never forges a log line, names
with a trailing newline are refused, and reports name models instead of the host's paths.

The API's side of the same holes: tests/api/test_hostile_input.py, tests/api/test_bounded_at_the_door.py
and tests/api/test_bad_input_refused.py; what a lease may make a GPU host run:
tests/workers/test_untrusted_api.py.
"""

from __future__ import annotations

import io
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from spectune_protocol import LeaseOut
from tests.support.helpers import wait_for
from tests.workers import test_agent as agent_tests
from tests.workers.test_agent import lease_body, running_agent, write_config
from workers.main import OneLineMessages

fake_api = agent_tests.api  # the scripted lease API on 127.0.0.1 (a fixture, defined once there)


# ------------------------------------------------------------------- leases outside the protocol
# Issue 18's "smaller holes" and "Bounded at the door" (their API side: tests/api/test_hostile_input.py,
# tests/api/test_bounded_at_the_door.py): a lease the wire model refuses is never worked on.


@pytest.mark.parametrize(
    "override",
    [
        {"heartbeat_interval_s": float("nan")},
        {"heartbeat_interval_s": 0},
        {"heartbeat_interval_s": 1e-9},
        {"heartbeat_interval_s": float("inf")},
        {"study": "demo\n2026-12-01 10:00:00 INFO spectune.worker: all good"},
        {"study": "demo\x1b[2J"},
        {"lease_id": "L-1\nforged"},
        {"attempt": 0},
        {"trial_number": -1},
    ],
)
def test_the_worker_refuses_leases_outside_the_protocol(override: dict[str, Any]) -> None:
    body = {**lease_body("L-1"), **override}
    with pytest.raises(ValidationError):
        LeaseOut.model_validate(body)


def test_a_nan_heartbeat_interval_is_refused_without_a_single_beat(
    tmp_path: Path, fake_api: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake, server = fake_api
    fake.queue = [lease_body("0" * 8 + "-0000-0000-0000-" + "0" * 12, heartbeat_interval_s=float("nan"))]
    lease_id = fake.queue[0]["lease_id"]
    with running_agent(write_config(tmp_path, server.url)):
        wait_for("the refusal", lambda: lease_id in fake.completed)
    failure = fake.reports()[lease_id].failure
    assert failure is not None and failure.kind == "refused" and not failure.host_fault
    assert "heartbeat_interval_s" in failure.message
    assert fake.names("heartbeat") == []


def test_worker_log_lines_cannot_be_forged() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(OneLineMessages())
    log = logging.getLogger("spectune.test.oneline")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("lease for study %s", "demo\n2026-12-01 INFO forged line\x1b[2J")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("with a traceback: %s", "x\ny")
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[0] == "lease for study demo\\x0a2026-12-01 INFO forged line\\x1b[2J"
    assert lines[1] == "with a traceback: x\\x0ay" and lines[2].startswith("Traceback")


def _lease_doc(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "lease_id": "0f4e8d4c-3a0b-4d43-9a52-2b1f6f0d9a10",
        "kind": "trial",
        "study": "s1",
        "trial_number": 3,
        "attempt": 1,
        "deadline": "2026-12-01T10:00:00+00:00",
        "heartbeat_interval_s": 30.0,
        "server": {"target": "m", "draft": "d", "max_running_requests": 8},
        "workload": {},
        "config": {"num_steps": 3, "topk": 1, "num_draft_tokens": 4},
    }
    for dotted, value in changes.items():
        node = doc
        keys = dotted.split("__")
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    return doc


def test_a_sound_lease_parses() -> None:
    assert LeaseOut.model_validate(_lease_doc()).study == "s1"


@pytest.mark.parametrize(
    "changes",
    [
        {"heartbeat_interval_s": math.nan},
        {"heartbeat_interval_s": math.inf},
        {"heartbeat_interval_s": 0.0},
        {"heartbeat_interval_s": 1e9},
        {"study": "s1\n2026-12-01 INFO forged line"},
        {"lease_id": "../../etc/passwd"},
        {"trial_number": -1},
        {"attempt": 10**9},
        {"server__target": "llama\n2026-12-01 INFO forged line"},
        {"server__target": "m" * 300},
        {"server__mem_fraction_static": math.nan},
        {"server__max_running_requests": 10**12},
        {"server__cuda_graph_bs": list(range(1, 100))},
        {"server__extra_args": {"--dtype": "bf16\r"}},
        {"server__extra_args": {"dtype": "bf16"}},
        {"server__extra_args": {f"--flag-{i}": True for i in range(33)}},
        {"server__attention_backend": "fa3\x1b[2J"},
        {"workload__repeats": 10**9},
        {"config__num_draft_tokens": 5000},
    ],
)
def test_a_lease_out_of_bounds_does_not_parse_on_the_worker(changes: dict[str, Any]) -> None:
    """A compromised API cannot make a worker loop, launch out of bounds or forge its log lines:
    such a lease is unreadable, refused by id (workers/client.py), never run.  (Paths, unknown
    models and option-like words are refused by the worker's own checks, naming the problem:
    tests/workers/test_untrusted_api.py.)"""
    with pytest.raises(ValidationError):
        LeaseOut.model_validate_json(json.dumps(_lease_doc(**changes)))


# ------------------------------------------------------------------- names and paths
# Issue 13 (its API side: tests/api/test_bad_input_refused.py).


def test_worker_side_names_with_a_trailing_newline_are_refused(tmp_path: Path) -> None:
    from workers.agent import _SAFE_WORD_RE
    from workers.config import FLAG_RE, WORKER_ID_RE
    from workers.loadgen.prompts import _FILE_NAME_RE

    for pattern, good in (
        (WORKER_ID_RE, "gpu-01"),
        (FLAG_RE, "--dtype"),
        (_FILE_NAME_RE, "p.jsonl"),
        (_SAFE_WORD_RE, "bf16"),
    ):
        assert pattern.match(good)
        assert not pattern.match(good + "\n"), pattern.pattern


def test_the_worker_names_models_instead_of_their_paths(tmp_path: Path) -> None:
    from spectune_protocol import CompleteIn
    from workers.redact import redact_report

    target = tmp_path / "models" / "llama"
    draft = target / "eagle3"  # kept inside the target's folder
    models = {"llama-3.1-8b": target, "llama-eagle3": draft}
    text = f"model_path='{target}' draft='{draft}' tokenizer_path='{target}/tok'"
    ok = CompleteIn.model_validate(
        {
            "outcome": "ok",
            "metrics": {
                "levels": [{"concurrency": 1, "output_tok_s": 10.0}],
                "log_tail": text,
                "effective": {"model_path": str(target), "nested": [{"p": str(draft)}], "n": 3},
            },
        }
    )
    out = redact_report(ok, models)
    assert out.metrics is not None
    assert str(tmp_path) not in out.metrics.log_tail + json.dumps(out.metrics.effective)
    assert out.metrics.log_tail == "model_path='llama-3.1-8b' draft='llama-eagle3' tokenizer_path='llama-3.1-8b/tok'"
    assert out.metrics.effective == {"model_path": "llama-3.1-8b", "nested": [{"p": "llama-eagle3"}], "n": 3}
    failed = CompleteIn.model_validate(
        {"outcome": "failed", "failure": {"kind": "crash", "message": f"cannot open {draft}", "log_tail": text}}
    )
    f = redact_report(failed, models).failure
    assert f is not None and str(tmp_path) not in f.message + f.log_tail
