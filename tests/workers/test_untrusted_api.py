"""The worker does not trust the API: what a lease may make a GPU host do is decided on the host.

A compromised (or buggy) API can send any lease it likes.  These tests send such leases to the
real agent (its real launcher, its own config) from a scripted API on 127.0.0.1 and check that
nothing outside the worker's own config is ever run or read: models outside the registry, server
flags outside `engine.allowed_extra_args`, word values that would read as options, and prompt
files outside the prompt folder are all refused as `refused` (a study fault, never counted against
the host) with a message that says how to fix it, before any server starts.
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

from optimizer.sglang import ServerSettings
from spectune_protocol import CompleteIn, LeaseOut
from tests.support.helpers import wait_for
from tests.workers import test_agent as agent_tests
from tests.workers.test_agent import TOKEN, FakeApi, lease_body, running_agent, write_config
from workers.agent import server_settings_refusal
from workers.config import DEFAULT_ALLOWED_EXTRA_ARGS, RESERVED_FLAGS, load_config
from workers.errors import ConfigError
from workers.main import OneLineMessages

api = agent_tests.api  # the scripted lease API on 127.0.0.1 (a fixture, defined once there)


def _with_extra(lease_id: str, extra: dict[str, Any], **over: Any) -> dict[str, Any]:
    body = lease_body(lease_id, **over)
    body["server"]["extra_args"] = extra
    return body


def _refusals(fake: FakeApi, ids: list[str]) -> dict[str, CompleteIn]:
    reports = fake.reports()
    for lid in ids:
        r = reports[lid]
        assert r.outcome == "failed" and r.failure is not None, r
        assert r.failure.kind == "refused" and r.failure.host_fault is False, r.failure
    return reports


def test_flags_outside_the_workers_allowlist_are_refused_before_any_launch(
    tmp_path: Path, api: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fake, server = api
    fake.queue = [
        # argparse keeps the last occurrence: this would replace the registry's model path.
        _with_extra("L-path", {"--model-path": "/etc"}),
        # Runs Python shipped with a model: not allowed unless the operator opts in.
        _with_extra("L-code", {"--trust-remote-code": True}),
        # Allowed flag, but a value that argparse would read as another option.
        _with_extra("L-value", {"--dtype": "--host=0.0.0.0"}),
        _with_extra("L-space", {"--dtype": "bf16 --port 1"}),
    ]
    config = write_config(tmp_path, server.url)
    with running_agent(config):
        wait_for("four refusals", lambda: len(fake.completed) == 4)
    reports = _refusals(fake, ["L-path", "L-code", "L-value", "L-space"])
    for lid, flag in (("L-path", "--model-path"), ("L-code", "--trust-remote-code")):
        message = reports[lid].failure.message  # type: ignore[union-attr]
        assert flag in message and "engine.allowed_extra_args" in message, message
    assert "--host=0.0.0.0" in reports["L-value"].failure.message  # type: ignore[union-attr]
    # Refused before the launcher ran: no engine was ever started, no server log written.
    assert "server started" not in caplog.text
    assert not any((tmp_path / "logs").glob("*")), list((tmp_path / "logs").glob("*"))
    assert TOKEN not in caplog.text


def test_an_operator_can_allow_a_flag_on_one_host(tmp_path: Path, api: Any) -> None:
    fake, server = api
    # A model outside the registry makes the lease end before a launch, after the flag check:
    # the report then names the registry, not the flag, which shows the flag was accepted.
    fake.queue = [_with_extra("L-1", {"--trust-remote-code": True}, target="not-here")]
    config = write_config(tmp_path, server.url)
    text = config.read_text().replace("[engine]\n", '[engine]\nallowed_extra_args = ["--trust-remote-code"]\n')
    config.write_text(text)
    assert load_config(config).engine.allowed_extra_args == ("--trust-remote-code",)
    with running_agent(config):
        wait_for("the report", lambda: "L-1" in fake.completed)
    failure = fake.reports()["L-1"].failure
    assert failure is not None
    message = failure.message
    assert "not-here" in message and "allowed_extra_args" not in message


@pytest.mark.parametrize("flag", sorted(RESERVED_FLAGS))
def test_the_config_cannot_allow_flags_that_name_paths_addresses_or_code(tmp_path: Path, flag: str) -> None:
    config = write_config(tmp_path, "http://127.0.0.1:9")
    config.write_text(config.read_text().replace("[engine]\n", f'[engine]\nallowed_extra_args = ["{flag}"]\n'))
    with pytest.raises(ConfigError, match="engine.allowed_extra_args") as err:
        load_config(config)
    assert flag in str(err.value)


def test_the_config_refuses_allowlist_entries_that_are_not_flags(tmp_path: Path) -> None:
    config = write_config(tmp_path, "http://127.0.0.1:9")
    config.write_text(config.read_text().replace("[engine]\n", '[engine]\nallowed_extra_args = ["dtype; rm -rf /"]\n'))
    with pytest.raises(ConfigError, match="not a server flag"):
        load_config(config)


def test_the_default_allowlist_is_within_the_apis_and_names_no_reserved_flag() -> None:
    from optimizer.spec import EXTRA_ARG_ALLOWLIST

    assert set(DEFAULT_ALLOWED_EXTRA_ARGS) <= set(EXTRA_ARG_ALLOWLIST)
    assert not set(DEFAULT_ALLOWED_EXTRA_ARGS) & RESERVED_FLAGS
    assert "--trust-remote-code" not in DEFAULT_ALLOWED_EXTRA_ARGS


def test_refusal_covers_typed_values_too() -> None:
    allowed = frozenset(DEFAULT_ALLOWED_EXTRA_ARGS)
    ok = ServerSettings(target="m", max_running_requests=1, extra_args={"--dtype": "bfloat16", "--dp-size": 2})
    assert server_settings_refusal(ok, allowed) is None
    bad_backend = ServerSettings(target="m", max_running_requests=1, attention_backend="--enable-metrics-x")
    assert "attention backend" in (server_settings_refusal(bad_backend, allowed) or "")


def test_models_outside_the_registry_are_refused(tmp_path: Path, api: Any) -> None:
    fake, server = api
    # A path in place of a registry name: never launched, never resolved.
    fake.queue = [lease_body("L-1", target="/srv/models/other"), lease_body("L-2", draft="../models/eagle")]
    with running_agent(write_config(tmp_path, server.url)):
        wait_for("two refusals", lambda: len(fake.completed) == 2)
    reports = _refusals(fake, ["L-1", "L-2"])
    assert "/srv/models/other" in reports["L-1"].failure.message  # type: ignore[union-attr]
    assert not any((tmp_path / "logs").glob("*"))


def test_prompt_files_outside_the_prompt_folder_are_never_read(tmp_path: Path, api: Any) -> None:
    fake, server = api
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's secret\n")
    config = write_config(tmp_path, server.url)
    # A plain file name inside the folder that is a symlink leading out of it.
    (tmp_path / "prompts" / "link.jsonl").symlink_to(secret)
    escaping = lease_body("L-link")
    escaping["workload"]["prompts"] = "link.jsonl"
    # A path: the wire model refuses it, so the lease is never worked on at all.
    traversal = lease_body("L-dots")
    traversal["workload"]["prompts"] = "../secret.txt"
    fake.queue = [escaping, traversal]
    with running_agent(config):
        wait_for("the refusal", lambda: "L-link" in fake.completed)
        wait_for("the worker to ask again", lambda: len(fake.names("lease")) >= 4)
    failure = _refusals(fake, ["L-link"])["L-link"].failure
    assert failure is not None
    assert "outside this worker's prompt folder" in failure.message, failure.message
    assert "the host's secret" not in failure.message + failure.log_tail
    # The path lease was never acted on: no report, no launch.
    assert "L-dots" not in fake.completed
    assert not any((tmp_path / "logs").glob("*"))


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
    tmp_path: Path, api: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake, server = api
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
    models and option-like words are refused by the worker's own checks, naming the problem: the
    tests above.)"""
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
