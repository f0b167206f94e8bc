"""The worker does not trust the API: what a lease may make a GPU host do is decided on the host.

A compromised (or buggy) API can send any lease it likes.  These tests send such leases to the
real agent (its real launcher, its own config) from a scripted API on 127.0.0.1 and check that
nothing outside the worker's own config is ever run or read: models outside the registry, server
flags outside `engine.allowed_extra_args`, word values that would read as options, and prompt
files outside the prompt folder are all refused as `refused` (a study fault, never counted against
the host) with a message that says how to fix it, before any server starts.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from optimizer.sglang import ServerSettings
from spectune_protocol import CompleteIn
from tests.support.helpers import wait_for
from tests.workers import test_agent as agent_tests
from tests.workers.test_agent import TOKEN, FakeApi, lease_body, running_agent, write_config
from workers.agent import server_settings_refusal
from workers.config import DEFAULT_ALLOWED_EXTRA_ARGS, RESERVED_FLAGS, load_config
from workers.errors import ConfigError

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
