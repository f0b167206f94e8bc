"""Typed payloads end to end (issue 32 item 3): every route declares what it answers, no route's
signature holds a free-form dict, a lease row's payload is read and written through one typed
model whose stored JSON is what the release before it stored, and the lease kinds and states are
defined once."""

from __future__ import annotations

import ast
import inspect
import typing
from datetime import UTC, datetime
from typing import Any

from fastapi.routing import APIRoute

from api.models import LeaseRow
from api.routes import fleet, leases, studies
from api.services import lease_rows
from api.services.leasing import records
from api.settings import Settings
from optimizer import conductor
from optimizer.plan import server_settings, workload_doc
from optimizer.space import SpecConfig
from optimizer.spec import parse_spec
from spectune_protocol import LeaseKind, LeaseOut, LeaseState
from tests.support.helpers import REPO
from tests.support.specs import small_spec

ROUTERS = (fleet.router, leases.router, studies.router)


def _free_form(annotation: Any) -> bool:
    """Does a type annotation hold `Any`, or a dict/Mapping of anything (at any depth)?"""
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (dict, typing.Mapping) or annotation in (dict, typing.Mapping):
        return True
    return any(_free_form(a) for a in args)


def test_every_route_declares_a_response_model_and_no_free_form_dict() -> None:
    seen = 0
    for router in ROUTERS:
        for route in router.routes:
            assert isinstance(route, APIRoute)
            seen += 1
            where = f"{sorted(route.methods)} {route.path}"
            if route.status_code != 204:
                assert route.response_model is not None, f"{where} declares no response model"
            hints = typing.get_type_hints(route.endpoint, include_extras=True)
            bad = {name: hint for name, hint in hints.items() if _free_form(hint)}
            assert not bad, f"{where}: free-form types in the signature: {bad}"
    assert seen >= 10  # the three routers' routes were all walked


def test_the_free_form_check_sees_a_dict_and_any() -> None:
    assert _free_form(list[dict[str, Any]]) and _free_form(dict[str, int]) and _free_form(Any | None)
    assert not _free_form(list[fleet.WorkerView]) and not _free_form(LeaseOut | None)


def _spec(**overrides: Any) -> Any:
    return parse_spec(small_spec("typed", **overrides))


def test_a_confirm_payload_stores_what_the_untyped_builder_stored() -> None:
    spec = _spec(objective={"metric": "goodput", "max_p99_ttft_ms": 500.0})
    config = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    info = lease_rows.ConfirmInfo(avoid_worker="w1", search_speedup=1.4, tier=2, envelope_note="smaller graphs")
    doc = lease_rows.lease_payload(spec, config, confirm=info).doc()
    # What api/services/lease_rows.py built as a dict before the payload was typed.
    assert doc == {
        "server": server_settings(spec, config).model_dump(mode="json"),
        "workload": workload_doc(spec.workload),
        "config": config.model_dump(mode="json"),
        "slo": {"ttft_ms": 500.0, "itl_ms": None},
        "confirm": {"avoid_worker": "w1", "search_speedup": 1.4, "tier": 2, "envelope_note": "smaller graphs"},
    }
    # Read back, it is the same document: no key gained or lost (an adaptive proof has no tier).
    row = LeaseRow(payload=doc)
    assert lease_rows.LeasePayload.of(row).doc() == doc
    adaptive = lease_rows.ConfirmInfo(adaptive=True, avoid_worker=None, search_speedup=None, envelope_note="")
    stored = lease_rows.lease_payload(spec, config, confirm=adaptive).doc()
    assert stored["confirm"] == {"adaptive": True, "avoid_worker": None, "search_speedup": None, "envelope_note": ""}
    assert lease_rows.LeasePayload.of(LeaseRow(payload=stored)).confirm.tier is None  # type: ignore[union-attr]


def test_a_trial_payload_has_no_slo_or_confirm_and_keeps_keys_of_another_release() -> None:
    spec = _spec()
    doc = lease_rows.lease_payload(spec, None).doc()
    assert set(doc) == {"server", "workload", "config"} and doc["config"] is None
    newer = doc | {"hint": "from a newer API"}
    assert lease_rows.LeasePayload.of(LeaseRow(payload=newer)).doc() == newer


def test_the_lease_a_worker_receives_is_built_from_the_typed_payload() -> None:
    spec = _spec()
    config = SpecConfig(num_steps=2, topk=1, num_draft_tokens=3)
    row = lease_rows.new_lease_row(
        spec, LeaseKind.TRIAL, datetime(2026, 1, 1), 60.0, worker_id="w1", config=config, number=4
    )
    out = records.lease_out(row, Settings())
    assert out.kind is LeaseKind.TRIAL and out.config == config and out.trial_number == 4
    assert out.deadline == datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
    # On the wire the kind is the word it always was.
    assert out.model_dump(mode="json")["kind"] == "trial"
    assert out.workload == spec.workload and out.server == server_settings(spec, config)


def test_lease_kind_and_state_are_defined_once() -> None:
    assert lease_rows.LeaseKind is LeaseKind and lease_rows.LeaseState is LeaseState
    hints = typing.get_type_hints(conductor.LeaseView)
    assert hints["kind"] is LeaseKind and hints["state"] is LeaseState
    assert typing.get_type_hints(LeaseOut)["kind"] is LeaseKind
    assert [s for s in LeaseState if s.live] == [LeaseState.QUEUED, LeaseState.ACTIVE]
    assert inspect.isclass(LeaseKind) and {k.value for k in LeaseKind} == {"baseline", "trial", "confirm"}


def test_a_worker_view_sends_its_database_times_with_their_utc_offset() -> None:
    naive = datetime(2026, 1, 1, 12, 0, 0)
    view = fleet.WorkerView.model_validate(
        {
            "id": "w1",
            "state": "ok",
            "health": "silent",
            "quarantine_reason": None,
            "consecutive_host_failures": 0,
            "last_seen": naive,
            "seconds_since_seen": 90.0,
            "sglang_version": "0.5.23",
            "config_digest": None,
            "refusals": [{"study": "s1", "lease_id": None, "at": naive, "message": "no such model"}],
            "inventory": {"hostname": "gpu-a", "gpus": [{"index": 0, "name": "H100", "memory_mib": 81559}]},
            "current_lease": {"lease_id": "l1", "study": "s1", "kind": "trial", "trial_number": 3, "deadline": naive},
            "recent_failures": [{"lease_id": "l0", "study": "s1", "state": "failed", "kind": "oom", "at": naive}],
        }
    )
    doc = view.model_dump(mode="json")
    assert doc["last_seen"] == doc["refusals"][0]["at"] == doc["current_lease"]["deadline"] == "2026-01-01T12:00:00Z"
    assert doc["current_lease"]["kind"] == "trial" and doc["inventory"]["gpus"][0]["memory_mib"] == 81559


# The one reader of the payload column (LeasePayload.of) and the column's declaration.
PAYLOAD_OWNERS = {"api/services/lease_rows.py", "api/models.py"}
DICT_METHODS = {"get", "items", "keys", "values", "copy", "pop", "setdefault", "update"}


def _is_payload(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "payload"


def raw_payload_reads(source: str) -> list[int]:
    """Lines where an attribute named `payload` is used as a dict: subscripted, a dict method called
    on it, copied with dict(...) or spread with `**` into a dict display."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and _is_payload(node.value):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in DICT_METHODS and _is_payload(func.value):
                lines.append(node.lineno)
            elif isinstance(func, ast.Name) and func.id == "dict" and any(_is_payload(a) for a in node.args):
                lines.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(
            k is None and _is_payload(v) for k, v in zip(node.keys, node.values, strict=True)
        ):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_raw_read_of_a_lease_payload_outside_its_typed_model() -> None:
    walked = 0
    bad = []
    for package in ("api", "optimizer"):
        for path in sorted((REPO / package).rglob("*.py")):
            where = path.relative_to(REPO).as_posix()
            walked += 1
            if where in PAYLOAD_OWNERS:
                continue
            bad += [f"{where}:{line}" for line in raw_payload_reads(path.read_text())]
    assert walked > 50  # both packages were walked
    assert not bad, f"read a lease payload through LeasePayload.of (api/services/lease_rows.py): {bad}"


def test_the_raw_payload_check_sees_each_form_of_a_dict_read() -> None:
    reads = [
        'row.payload["tier"]',
        'lease.payload.get("confirm")',
        '(r.payload.get("confirm") or {}).get("adaptive")',
        "dict(row.payload)",
        '{**row.payload, "confirm": {}}',
        'row.payload["server"] = {}',
    ]
    for text in reads:
        assert raw_payload_reads(text) == [1], text
    typed = 'LeasePayload.of(row).confirm_info.tier\npayload.get("x")\nrow.payload = doc\nreport.payload.model_dump()'
    assert raw_payload_reads(typed) == []


def test_a_confirmation_record_read_and_written_back_stores_the_same_keys() -> None:
    """The actions carry a confirmation as optimizer.store.ConfirmInfo; a payload read into it and
    written back (as a claim or a retry does) keeps its keys, a newer release's included."""
    spec = _spec()
    config = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    info = lease_rows.ConfirmInfo(avoid_worker="w1", search_speedup=1.4, tier=2, envelope_note="smaller graphs")
    doc = lease_rows.lease_payload(spec, config, confirm=info).doc()
    doc["confirm"] = {**doc["confirm"], "hint": "from a newer API"}  # type: ignore[dict-item]
    payload = lease_rows.LeasePayload.of(LeaseRow(payload=doc))
    record = payload.confirm_info.record()
    assert (record.tier, record.avoid_worker, record.extra) == (2, "w1", {"hint": "from a newer API"})
    payload.confirm = lease_rows.ConfirmInfo.of_record(record)
    assert payload.doc() == doc
    # The adaptive proof launches in no envelope; a trial's payload has an empty confirmation.
    adaptive = lease_rows.ConfirmInfo.of_record(lease_rows.ConfirmInfo(adaptive=True, tier=3).record())
    assert adaptive.launch_tier is None and "tier" not in adaptive.model_dump(exclude_unset=True)
    trial = lease_rows.LeasePayload.of(LeaseRow(payload=lease_rows.lease_payload(spec, config).doc()))
    assert trial.confirm is None and trial.confirm_info.launch_tier is None and trial.config == config
