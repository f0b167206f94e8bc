"""spectune's assumptions about one SGLang version, checked against that version's own source.

The flags are spectune's own argv (`optimizer.sglang.build_server_args`, which the worker's
launcher runs as is: workers/launcher/argv.py) for servers of every shape it launches, so a
flag added to the builder is checked without a table to keep in step.  Each finding is one
line naming the flag or fact, the version and the SGLang file it was read from.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from optimizer.deploy import SPEC_DEFAULT_MAX_RUNNING_REQUESTS
from optimizer.memory_boundary import capture_list
from optimizer.sglang import (
    ADAPTIVE_SINCE,
    ADAPTIVE_STEPS_OFF_SINCE,
    AdaptiveSteps,
    ServerSettings,
    build_server_args,
    parse_version,
)
from optimizer.space import SpecConfig
from optimizer.spec import ATTENTION_BACKENDS, EXTRA_ARG_ALLOWLIST
from spectune.conformance.source import (
    Option,
    WheelSource,
    adaptive_schema,
    assigns_steps_plus_one,
    int_assignments,
    read_options,
    speculative_capture_sizes,
)


@dataclass
class Report:
    version: str
    problems: list[str] = field(default_factory=list)  # spectune would launch something this SGLang refuses
    notes: list[str] = field(default_factory=list)  # spectune is stricter than this SGLang needs

    @property
    def ok(self) -> bool:
        return not self.problems


def servers(version: str) -> Iterator[ServerSettings]:
    """One server of every shape spectune launches: each flag the builder can emit appears."""
    base = ServerSettings(target="t", max_running_requests=64, mem_fraction_static=0.85, context_length=8192)
    yield base
    yield base.model_copy(update={"cuda_graph_bs": (1, 2, 4, 8), "attention_backend": "flashinfer"})
    tree = SpecConfig(num_steps=3, topk=4, num_draft_tokens=8)
    yield base.model_copy(update={"draft": "d", "speculative": tree, "cuda_graph_max_bs": 32})
    chain = SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    yield base.model_copy(update={"draft": "d", "speculative": chain, "cuda_graph_bs": (1, 8, 32)})
    if parse_version(version) >= ADAPTIVE_SINCE:
        adaptive = AdaptiveSteps(steps_by_batch={1: 3, 8: 2})
        yield base.model_copy(update={"draft": "d", "speculative": chain, "adaptive": adaptive})


def argv_of(settings: ServerSettings, version: str) -> list[str]:
    return build_server_args(
        settings, version=version, model_path="/m/t", draft_model_path="/m/d", adaptive_config_path="/run/a.json"
    )


def split_flags(argv: Sequence[str]) -> list[tuple[str, list[str]]]:
    """`[--a, 1, --b, --c, 2, 3]` -> `[(--a, [1]), (--b, []), (--c, [2, 3])]`."""
    out: list[tuple[str, list[str]]] = []
    for token in argv:
        if token.startswith("--"):
            out.append((token, []))
        elif out:
            out[-1][1].append(token)
    return out


def resolve_flag(flag: str, table: dict[str, Option]) -> tuple[Option | None, str | None]:
    """What argparse (allow_abbrev, SGLang's default) makes of `flag`: the option, or why not."""
    if flag in table:
        return table[flag], None
    prefixed = sorted(s for s in table if s.startswith(flag))
    if len(prefixed) > 1:
        return None, f"is an ambiguous abbreviation of {', '.join(prefixed)} (argparse exits 2)"
    if prefixed:
        return None, f"does not exist; argparse would silently read it as {prefixed[0]}"
    return None, "does not exist"


_INT_TYPES = ("int", "human_readable_int")


def value_problem(option: Option, values: list[str]) -> str | None:
    arity = {"flag": len(values) == 0, "value": len(values) == 1, "values": len(values) >= 1}
    if option.kind in arity and not arity[option.kind]:
        return f"takes {option.kind!r} in SGLang but spectune passes {len(values)} value(s) {values}"
    for v in values:
        try:
            if option.type in _INT_TYPES:
                int(v)
            elif option.type == "float":
                float(v)
        except ValueError:
            return f"wants {option.type} but spectune passes {v!r}"
        if option.choices is not None and v not in option.choices:
            return f"accepts {', '.join(option.choices)} but spectune passes {v!r}"
    return None


def check_flags(version: str, src: WheelSource, report: Report) -> None:
    table = {s: o for o in read_options(src) for s in o.strings}
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for settings in servers(version):
        for flag, values in split_flags(argv_of(settings, version)):
            if (flag, tuple(values)) in seen:
                continue
            seen.add((flag, tuple(values)))
            option, why = resolve_flag(flag, table)
            if option is None:
                report.problems.append(f"SGLang {version}: {flag} {why} (spectune emits it: optimizer/sglang.py)")
                continue
            problem = value_problem(option, values)
            if problem is not None:
                report.problems.append(f"SGLang {version}: {flag} {problem} ({option.where})")


_SPEC_TYPES: dict[type, tuple[str, ...]] = {int: _INT_TYPES, float: ("float",)}


def check_extra_flags(version: str, src: WheelSource, report: Report) -> None:
    """The extra flags a study may pass (optimizer/spec.py EXTRA_ARG_ALLOWLIST), as spectune types them."""
    table = {s: o for o in read_options(src) for s in o.strings}
    for flag, kind in sorted(EXTRA_ARG_ALLOWLIST.items()):
        option, why = resolve_flag(flag, table)
        if option is None:
            report.problems.append(f"SGLang {version}: extra flag {flag} {why} (optimizer/spec.py EXTRA_ARG_ALLOWLIST)")
        elif (kind is None) != (option.kind == "flag"):
            want = "a switch" if kind is None else "a value"
            report.problems.append(
                f"SGLang {version}: extra flag {flag} is {option.kind!r} in SGLang ({option.where}); "
                f"optimizer/spec.py EXTRA_ARG_ALLOWLIST passes {want}"
            )
        elif kind in _SPEC_TYPES and option.type is not None and option.type not in _SPEC_TYPES[kind]:
            report.problems.append(
                f"SGLang {version}: extra flag {flag} wants {option.type} ({option.where}); "
                f"optimizer/spec.py EXTRA_ARG_ALLOWLIST passes {kind.__name__}"
            )


def check_backends(version: str, src: WheelSource, report: Report) -> None:
    """The attention backends a study spec may name (optimizer/spec.py) that this version lacks.

    A note, not a failure: the user picks the backend, and a study naming one the host's SGLang
    lacks fails its launches there (argparse exit 2); the default (fa3) is checked with the flags.
    """
    table = {s: o for o in read_options(src) for s in o.strings}
    option = table.get("--attention-backend")
    if option is None or option.choices is None:
        return
    missing = [b for b in ATTENTION_BACKENDS if b not in option.choices]
    if missing:
        report.notes.append(
            f"SGLang {version} has no attention backend {', '.join(missing)} ({option.where}): "
            "a study naming it cannot launch on this version"
        )


def check_defaults(version: str, src: WheelSource, report: Report) -> None:
    # With speculation and no --max-running-requests, SGLang caps it (docs/sglang.md §2 rule 7).
    caps = {
        value: where
        for value, where in int_assignments(src, "max_running_requests").items()
        if all("speculative" in w for w in where)
    }
    if SPEC_DEFAULT_MAX_RUNNING_REQUESTS not in caps:
        report.problems.append(
            f"SGLang {version}: no speculative default of max_running_requests = {SPEC_DEFAULT_MAX_RUNNING_REQUESTS} "
            f"(found {sorted(caps) or 'none'}); spectune assumes it (optimizer/deploy.py SPEC_DEFAULT_MAX_RUNNING_REQUESTS)"
        )
    # topk 1 fixes the draft tokens at steps + 1 (rule 2).
    if not assigns_steps_plus_one(src):
        report.problems.append(
            f"SGLang {version}: no `speculative_num_draft_tokens = speculative_num_steps + 1` for topk 1; "
            "spectune derives chains' draft tokens so (optimizer/space.py SpecConfig.canonical)"
        )
    # The default capture list with speculation (docs/sglang.md §3).
    for top in (48, 256, 1024):
        found = speculative_capture_sizes(src, top)
        ours = list(capture_list(ServerSettings(target="t", max_running_requests=top, cuda_graph_max_bs=top)))
        if found is None:
            report.problems.append(f"SGLang {version}: no speculative CUDA-graph capture list generator found")
            break
        sizes, where = found
        if sizes != ours:
            report.problems.append(
                f"SGLang {version}: captures {sizes} up to {top} with speculation ({where}); spectune assumes "
                f"{ours} (optimizer/memory_boundary.py capture_list)"
            )
            break


def check_adaptive(version: str, src: WheelSource, report: Report) -> None:
    v = parse_version(version)
    if v < ADAPTIVE_SINCE:
        return
    schema = adaptive_schema(src)
    if schema is None or not (schema.integer_keys and schema.steps_key):
        report.problems.append(
            f"SGLang {version}: the adaptive config loader no longer reads integer-string batch keys with "
            "`candidate_steps` (speculative/adaptive_spec_params.py); spectune writes that file (AdaptiveSteps.config_doc)"
        )
        return
    ours = 0 if v >= ADAPTIVE_STEPS_OFF_SINCE else 1
    if schema.min_step is None:
        report.problems.append(
            f"SGLang {version}: no check of candidate_steps' lower bound found in {version}'s loader"
        )
    elif schema.min_step > ours:
        report.problems.append(
            f"SGLang {version}: candidate_steps must be >= {schema.min_step}, but spectune writes steps >= {ours} "
            "(optimizer/sglang.py ADAPTIVE_STEPS_OFF_SINCE)"
        )
    elif schema.min_step < ours:
        report.notes.append(
            f"SGLang {version} accepts candidate_steps >= {schema.min_step}; spectune allows >= {ours} only "
            "(optimizer/sglang.py ADAPTIVE_STEPS_OFF_SINCE is later than needed)"
        )


def check(version: str, src: WheelSource) -> Report:
    report = Report(version)
    check_flags(version, src, report)
    check_extra_flags(version, src, report)
    check_backends(version, src, report)
    check_defaults(version, src, report)
    check_adaptive(version, src, report)
    return report
