"""Every list and string in the study spec is bounded (issue 35, item 5).

Seen on cc094f3: 11,000 distinct warm starts (607 kB) were accepted; create took two minutes and
every lease and report of every study slowed.  The schema walk below fails on any list, string or
open mapping without a bound, so a field added later cannot be unbounded by accident.
"""

from __future__ import annotations

from typing import Any

from optimizer.spec import MAX_GRID_CONFIGS, StudySpec
from tests.support.api_client import Api
from tests.support.specs import small_spec


def unbounded(schema: dict[str, Any]) -> list[str]:
    """Paths in a JSON schema to arrays without maxItems, strings without maxLength (or a fixed
    set of values), and open mappings without maxProperties or with unbounded keys."""
    defs = schema.get("$defs", {})
    found: list[str] = []
    seen: set[str] = set()

    def walk(node: Any, path: str) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{path}[{i}]")
            return
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str):
            name = ref.rsplit("/", 1)[-1]
            if name not in seen:
                seen.add(name)
                walk(defs[name], f"{path}<{name}>")
            return
        kind = node.get("type")
        if kind == "array" and "maxItems" not in node:
            found.append(f"{path}: a list without maxItems")
        if kind == "string" and not ({"maxLength", "enum", "const"} & node.keys()):
            found.append(f"{path}: a string without maxLength")
        if kind == "object" and node.get("additionalProperties") not in (None, False):
            if "maxProperties" not in node:
                found.append(f"{path}: a mapping without maxProperties")
            if "maxLength" not in node.get("propertyNames", {}):
                found.append(f"{path}: a mapping whose keys have no maxLength")
        for key, value in node.items():
            if key != "$defs":
                walk(value, f"{path}/{key}")

    walk(schema, "")
    return found


def test_every_list_string_and_mapping_in_the_spec_schema_is_bounded() -> None:
    assert unbounded(StudySpec.model_json_schema()) == []


def test_the_walk_finds_an_unbounded_field() -> None:
    # The walk itself can fail: a schema with one of each unbounded kind names all three.
    schema = {
        "type": "object",
        "properties": {
            "xs": {"type": "array", "items": {"type": "integer"}},
            "s": {"type": "string"},
            "m": {"type": "object", "additionalProperties": {"type": "integer"}},
            "ok": {"type": "string", "enum": ["a"]},
        },
    }
    assert len(unbounded(schema)) == 4  # the mapping lacks both its size and its keys' length


def test_warm_starts_have_the_grids_cap(api: Api) -> None:
    one = {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}
    # The reproduction's size: 11,000 warm starts, refused at the door before any is checked.
    r = api.post("/v1/studies", "user", small_spec("many-warm", warm_start=[one] * 11_000))
    assert r.status_code == 422, r.text[:500]
    assert "warm_start" in r.text and f"{MAX_GRID_CONFIGS}" in r.text.replace(",", ""), r.text[:500]
    assert api.get("/v1/studies/many-warm", "user").status_code == 404
    r = api.post("/v1/studies", "user", small_spec("few-warm", warm_start=[one] * 3))
    assert r.status_code == 201, r.text


def test_long_strings_and_many_flags_are_refused_naming_the_field(api: Api) -> None:
    cases = {
        "placement": {"placement": {"k" * 64: "v"}},
        "extra_args": {
            "model": {**small_spec("x")["model"], "extra_args": {f"--x{i}": True for i in range(100)}},
        },
        "prompts": {"workload": {"prompts": "p" * 200}},
    }
    for field, overrides in cases.items():
        r = api.post("/v1/studies", "user", small_spec("long", **overrides))
        assert r.status_code == 422, (field, r.text)
        assert field in r.text, (field, r.text)
