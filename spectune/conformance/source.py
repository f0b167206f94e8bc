"""SGLang's launch options and resolution code, read from a wheel's source by AST (never imported).

SGLang declared its options three ways over the supported releases: `parser.add_argument(...)`
calls (0.5.13), annotated fields `name: A[T, "help" | Arg(...)]` of `ServerArgs` turned into
options by `add_cli_args_from_dataclass` (0.5.14-0.5.19, in `srt/server_args.py`), and the same
fields split over `srt/arg_groups/fields/*.py` (0.5.20 on).  This module reads all three into one
table of `Option`s, mirroring what `arg_utils.add_cli_args_from_dataclass` does with a field:
`--` + the name with dashes (or `Arg(cli_name=...)`) plus `aliases`, nothing for `no_cli`,
`Literal[...]` gives choices, `bool` a store-true flag, `List[X]` nargs "+".
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Kind = Literal["flag", "value", "values", "optional"]

# Where the launch parser and its resolution live, relative to the wheel's root.
_PREFIXES = ("sglang/srt/server_args.py", "sglang/srt/arg_groups/", "sglang/srt/speculative/adaptive_spec_params.py")


@dataclass(frozen=True)
class Option:
    """One argparse action of SGLang's launch parser, as far as the source says statically."""

    strings: tuple[str, ...]
    kind: Kind
    type: str | None  # "int", "float", "str", a parser function's name, or None (argparse: str)
    choices: tuple[str, ...] | None  # None: unrestricted, or not readable statically
    where: str  # "sglang/srt/server_args.py:5675"


@dataclass
class WheelSource:
    """The files of one SGLang wheel this check reads, path -> text."""

    files: dict[str, str]
    _trees: dict[str, ast.Module] = field(default_factory=dict)

    @classmethod
    def from_wheel(cls, wheel: Path) -> WheelSource:
        with zipfile.ZipFile(wheel) as z:
            return cls({n: z.read(n).decode() for n in z.namelist() if n.endswith(".py") and n.startswith(_PREFIXES)})

    def tree(self, path: str) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(self.files[path], filename=path)
        return self._trees[path]

    def trees(self) -> Iterator[tuple[str, ast.Module]]:
        for path in sorted(self.files):
            yield path, self.tree(path)


def _constants(src: WheelSource) -> dict[str, tuple[str, ...]]:
    """Module-level `NAME = [ "a", "b", ... ]` lists of strings (choices are often named)."""
    out: dict[str, tuple[str, ...]] = {}
    for _path, tree in src.trees():
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                values = _literal_strings(node.value, {})
                if values is not None:
                    out[node.targets[0].id] = values
    return out


def _literal_strings(node: ast.expr | None, named: Mapping[str, tuple[str, ...]]) -> tuple[str, ...] | None:
    if isinstance(node, ast.Name):
        return named.get(node.id)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        if all(isinstance(e, ast.Constant) and isinstance(e.value, (str, int)) for e in node.elts):
            return tuple(str(e.value) for e in node.elts if isinstance(e, ast.Constant))
    return None


def _name_of(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _kind_of_action(action: str | None, nargs: object) -> Kind:
    if action is not None and (
        action in ("store_true", "store_false", "store_const", "count")
        or "StoreTrue" in action
        or "StoreConst" in action
    ):
        return "flag"
    if nargs in ("+", "*") or (isinstance(nargs, int) and nargs > 1):
        return "values"
    if nargs == "?":
        return "optional"
    return "value"


def _from_add_argument(call: ast.Call, named: Mapping[str, tuple[str, ...]], where: str) -> Option | None:
    strings = tuple(
        a.value
        for a in call.args
        if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")
    )
    if not strings:
        return None
    kw = {k.arg: k.value for k in call.keywords if k.arg is not None}
    nargs_node = kw.get("nargs")
    nargs = nargs_node.value if isinstance(nargs_node, ast.Constant) else None
    return Option(
        strings=strings,
        kind=_kind_of_action(_name_of(kw.get("action")), nargs),
        type=_name_of(kw.get("type")),
        choices=_literal_strings(kw.get("choices"), named),
        where=where,
    )


def _unwrap_optional(node: ast.expr) -> ast.expr:
    """`Optional[X]` / `X | None` -> X."""
    if isinstance(node, ast.Subscript) and _name_of(node.value) == "Optional":
        return node.slice
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        if isinstance(node.right, ast.Constant) and node.right.value is None:
            return node.left
        if isinstance(node.left, ast.Constant) and node.left.value is None:
            return node.right
    return node


def _from_field(
    name: str, annotation: ast.Subscript, named: Mapping[str, tuple[str, ...]], where: str
) -> Option | None:
    """An `A[T, "help"]` / `A[T, Arg(...)]` field as `add_cli_args_from_dataclass` registers it."""
    parts = annotation.slice
    if not isinstance(parts, ast.Tuple) or len(parts.elts) < 2:
        return None
    tp, meta = parts.elts[0], parts.elts[1]
    kw: dict[str, ast.expr] = {}
    if isinstance(meta, ast.Call) and _name_of(meta.func) == "Arg":
        kw = {k.arg: k.value for k in meta.keywords if k.arg is not None}
    elif not (isinstance(meta, (ast.Constant, ast.JoinedStr, ast.BinOp))):
        return None  # not CLI metadata: the field is registered by hand, if at all
    no_cli = kw.get("no_cli")
    if isinstance(no_cli, ast.Constant) and no_cli.value is True:
        return None
    cli_name = kw.get("cli_name")
    first = cli_name.value if isinstance(cli_name, ast.Constant) else "--" + name.replace("_", "-")
    aliases = _literal_strings(kw.get("aliases"), {}) or ()
    strings = (str(first), *aliases)
    choices = _literal_strings(kw.get("choices"), named)
    type_parser = _name_of(kw.get("type_parser"))
    action = _name_of(kw.get("action"))
    inner = _unwrap_optional(tp)
    inner_name = _name_of(inner.value) if isinstance(inner, ast.Subscript) else _name_of(inner)
    nargs_node = kw.get("nargs")
    nargs = nargs_node.value if isinstance(nargs_node, ast.Constant) else None
    if action is not None:
        return Option(strings, _kind_of_action(action, nargs), type_parser, choices, where)
    if inner_name == "Literal" and isinstance(inner, ast.Subscript):
        values = inner.slice.elts if isinstance(inner.slice, ast.Tuple) else [inner.slice]
        lits = tuple(v.value for v in values if isinstance(v, ast.Constant))
        kind_type = type(lits[0]).__name__ if lits else "str"
        return Option(strings, "value", type_parser or kind_type, choices or tuple(str(v) for v in lits), where)
    if inner_name in ("List", "list") and type_parser is None and isinstance(inner, ast.Subscript):
        return Option(strings, _kind_of_action(None, nargs or "+"), _name_of(inner.slice), choices, where)
    if inner_name == "bool":
        return Option(strings, "flag", None, None, where)
    return Option(strings, _kind_of_action(None, nargs), type_parser or inner_name, choices, where)


def read_options(src: WheelSource) -> list[Option]:
    """Every option of the launch parser the source declares."""
    named = _constants(src)
    options: list[Option] = []
    for path, tree in src.trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _name_of(node.func) == "add_argument":
                opt = _from_add_argument(node, named, f"{path}:{node.lineno}")
                if opt is not None:
                    options.append(opt)
            elif (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(node.annotation, ast.Subscript)
                and _name_of(node.annotation.value) in ("A", "Annotated")
            ):
                opt = _from_field(node.target.id, node.annotation, named, f"{path}:{node.lineno}")
                if opt is not None:
                    options.append(opt)
    return options


# --- the resolution code spectune relies on ---------------------------------------------------


def _assigned(tree: ast.Module, attr: str) -> Iterator[tuple[ast.expr, int]]:
    """Values given to `<x>.attr = v` or `attr=v` (a keyword, as in `replace(cfg, attr=v)`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and t.attr == attr:
                    yield node.value, node.lineno
        elif isinstance(node, ast.keyword) and node.arg == attr:
            yield node.value, getattr(node, "lineno", 0)


def int_assignments(src: WheelSource, attr: str) -> dict[int, list[str]]:
    """Every constant integer the resolution code assigns to `attr`, with where."""
    out: dict[int, list[str]] = {}
    for path, tree in src.trees():
        for value, line in _assigned(tree, attr):
            if isinstance(value, ast.Constant) and type(value.value) is int:
                out.setdefault(value.value, []).append(f"{path}:{line}")
    return out


def assigns_steps_plus_one(src: WheelSource) -> list[str]:
    """Where the draft tokens are set to `speculative_num_steps + 1` (topk 1 makes a chain)."""
    found: list[str] = []
    for path, tree in src.trees():
        for value, line in _assigned(tree, "speculative_num_draft_tokens"):
            if (
                isinstance(value, ast.BinOp)
                and isinstance(value.op, ast.Add)
                and _name_of(value.left) == "speculative_num_steps"
                and isinstance(value.right, ast.Constant)
                and value.right.value == 1
            ):
                found.append(f"{path}:{line}")
    return found


def _is_spec_none_test(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and _name_of(test.left) == "speculative_algorithm"
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Is)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    )


def _eval_sizes(node: ast.expr, max_bs: int) -> list[int]:
    """Evaluate `list(range(..)) + [..] + ...`; any non-constant bound is the largest batch."""

    def num(n: ast.expr) -> int:
        if isinstance(n, ast.Constant) and type(n.value) is int:
            return n.value
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add):
            return num(n.left) + num(n.right)
        return max_bs  # `max_bs`, `self.cuda_graph_max_bs`, ...

    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _eval_sizes(node.left, max_bs) + _eval_sizes(node.right, max_bs)
    if isinstance(node, ast.List):
        return [num(e) for e in node.elts]
    if isinstance(node, ast.Call) and _name_of(node.func) == "list" and node.args:
        return _eval_sizes(node.args[0], max_bs)
    if isinstance(node, ast.Call) and _name_of(node.func) == "range":
        return list(range(*(num(a) for a in node.args)))
    raise ValueError(f"cannot read a capture list from {ast.unparse(node)!r}")


def speculative_capture_sizes(src: WheelSource, max_bs: int) -> tuple[list[int], str] | None:
    """SGLang's default decode capture list with speculation for `max_bs`, read from its generator
    (`_generate_cuda_graph_batch_sizes` / `generate_decode_cuda_graph_batch_sizes`): the `else` of
    `if ... speculative_algorithm is None`, cut at `max_bs` with `max_bs` appended, as the code does."""
    for path, tree in src.trees():
        for fn in ast.walk(tree):
            if not (
                isinstance(fn, ast.FunctionDef) and "cuda_graph_batch_sizes" in fn.name and "prefill" not in fn.name
            ):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.If) and _is_spec_none_test(node.test):
                    assign = node.orelse[0] if node.orelse else None
                    if isinstance(assign, ast.Assign):
                        sizes = [s for s in _eval_sizes(assign.value, max_bs) if s <= max_bs]
                        if max_bs not in sizes:
                            sizes.append(max_bs)
                        return sizes, f"{path}:{fn.lineno}"
    return None


ADAPTIVE_FILE = "sglang/srt/speculative/adaptive_spec_params.py"


@dataclass(frozen=True)
class AdaptiveSchema:
    """What SGLang's adaptive config loader accepts, as its source says."""

    integer_keys: bool  # keys filtered by `key.isdigit()`
    steps_key: bool  # entries read with `entry.get("candidate_steps")`
    min_step: int | None  # 0 (`s >= 0`) or 1 (`s > 0`); None when no such check was found


def adaptive_schema(src: WheelSource) -> AdaptiveSchema | None:
    if ADAPTIVE_FILE not in src.files:
        return None
    tree = src.tree(ADAPTIVE_FILE)
    integer_keys = steps_key = False
    min_step: int | None = None
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
        reads_steps = any(
            _name_of(c.func) == "get"
            and c.args
            and isinstance(c.args[0], ast.Constant)
            and c.args[0].value == "candidate_steps"
            for c in calls
        )
        if not reads_steps:
            continue  # only the loader validates the file; the class methods route steps at run time
        steps_key = True
        integer_keys = integer_keys or any(_name_of(c.func) == "isdigit" for c in calls)
        for call in calls:
            if _name_of(call.func) != "all":
                continue
            for cmp in ast.walk(call):
                if (
                    isinstance(cmp, ast.Compare)
                    and len(cmp.ops) == 1
                    and isinstance(cmp.comparators[0], ast.Constant)
                    and cmp.comparators[0].value == 0
                ):
                    min_step = 0 if isinstance(cmp.ops[0], ast.GtE) else 1 if isinstance(cmp.ops[0], ast.Gt) else None
    return AdaptiveSchema(integer_keys, steps_key, min_step)
