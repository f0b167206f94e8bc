"""Can any registered worker take a study?  Computed on read from the workers' last inventories.

A study that no worker can take would otherwise sit at "0 launched" in silence: its target or
draft is in no worker's registry, no worker carries its placement labels, none has the GPUs its
tensor parallelism needs, its workload's prompt file is in no worker's prompt folder, or every
worker that could take it is quarantined.  Workers send their
inventory with every lease call (at least once per idle poll), so the answer is as fresh as the
fleet table: nothing is stored, and nothing has to expire.

`requirements_unmet()` is also the lease service's filter, so the warning and the hand-out can
never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from optimizer.spec import StudySpec


def gpu_count(inventory: Mapping[str, Any]) -> int | None:
    """GPUs the worker may use: the GPUs it reported, else a positive `gpu_count` label; None when unknown.

    A worker without NVML (the simulated engine, a container without the driver) reports no GPUs
    and derives `gpu_count = "0"`: that is "cannot see", not "has none".
    """
    gpus = inventory.get("gpus") or []
    if gpus:
        return len(gpus)
    label = (inventory.get("labels") or {}).get("gpu_count")
    n = int(label) if isinstance(label, str) and label.isdigit() else 0
    return n if n > 0 else None


def requirements_unmet(spec: StudySpec, inventory: Mapping[str, Any]) -> list[str]:
    """Which of the study's requirements this worker's inventory does not meet ([] = it can take it)."""
    out = []
    models = set(inventory.get("models") or [])
    if spec.model.target not in models or spec.model.draft not in models:
        out.append("models")
    labels = inventory.get("labels") or {}
    if any(labels.get(k) != v for k, v in spec.placement.items()):
        out.append("placement")
    n = gpu_count(inventory)
    # A worker that cannot see its GPUs (no NVML, a simulated engine) is not turned away for it.
    if n is not None and n < spec.model.tp_size:
        out.append("gpus")
    if not has_prompt_file(spec, inventory):
        out.append("prompts")
    return out


def has_prompt_file(spec: StudySpec, inventory: Mapping[str, Any]) -> bool:
    """The worker's prompt folder holds the workload's file (a built-in set every worker has).

    A worker older than the `prompt_files` inventory field is not turned away: it refuses at
    the lease instead, as before.
    """
    name = spec.workload.prompts
    files = inventory.get("prompt_files")
    return name.startswith("builtin:") or files is None or name in files


@dataclass(frozen=True)
class WorkerView:
    id: str
    inventory: Mapping[str, Any]
    quarantined: bool
    quarantine_reason: str | None = None
    # Refused what this study asks (a study fault): the lease service no longer offers it the study.
    refused: bool = False


@dataclass(frozen=True)
class Eligibility:
    eligible_workers: list[str]  # can take it now (not quarantined)
    quarantined_workers: list[str]  # could take it, but are quarantined
    unmet: list[str] = field(default_factory=list)  # requirement names no worker meets
    warning: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "eligible_workers": self.eligible_workers,
            "quarantined_workers": self.quarantined_workers,
            "unmet": self.unmet,
            "warning": self.warning,
        }


def eligibility(spec: StudySpec, workers: Sequence[WorkerView]) -> Eligibility:
    matching = [w for w in workers if not requirements_unmet(spec, w.inventory)]
    fits = [w for w in matching if not w.refused]
    ok = sorted(w.id for w in fits if not w.quarantined)
    held = [w for w in fits if w.quarantined]
    if ok:
        return Eligibility(ok, sorted(w.id for w in held))
    if not workers:
        return Eligibility([], [], ["workers"], "no worker has registered yet: nothing can run this study")
    if matching and not fits:
        names = ", ".join(sorted(w.id for w in matching))
        return Eligibility(
            [],
            [],
            ["refused"],
            f"every worker that could take this study refused what it asks ({names}; see refused_by): "
            "change the study, or the workers' configs and restart them (a changed config ends their "
            "refusals), or `spectune workers clear-refusals ID`",
        )
    if held:
        why = "; ".join(f"{w.id}: {w.quarantine_reason or 'quarantined'}" for w in sorted(held, key=lambda w: w.id))
        return Eligibility(
            [],
            sorted(w.id for w in held),
            ["quarantine"],
            f"every worker that could take this study is quarantined ({why}); "
            "fix the host, then `spectune workers release ID`",
        )
    per_requirement = {
        "models": _models_text(spec, workers),
        "placement": _placement_text(spec, workers),
        "gpus": _gpus_text(spec, workers),
        "prompts": f"no worker's prompt folder holds {spec.workload.prompts} (put it in the prompt_dir of the "
        "workers that should run it and restart them)",
    }
    unmet = [r for r in per_requirement if all(r in requirements_unmet(spec, w.inventory) for w in workers)]
    if unmet:
        text = "; ".join(per_requirement[r] for r in unmet)
    else:
        unmet = ["combination"]
        text = "each requirement is met by some worker, but no single worker meets models, placement, GPU count and prompt file"
    return Eligibility([], [], unmet, f"no registered worker can take this study: {text}")


def _models_text(spec: StudySpec, workers: Sequence[WorkerView]) -> str:
    wanted = [spec.model.target, spec.model.draft]
    held = {m for w in workers for m in w.inventory.get("models") or []}
    missing = [m for m in wanted if m not in held]
    if missing:
        return f"no worker's model registry holds {' and '.join(missing)}"
    return f"no worker's registry holds both {spec.model.target} and {spec.model.draft}"


def _placement_text(spec: StudySpec, workers: Sequence[WorkerView]) -> str:
    want = ", ".join(f"{k}={v}" for k, v in sorted(spec.placement.items()))
    return f"no worker carries the placement labels {want}"


def _gpus_text(spec: StudySpec, workers: Sequence[WorkerView]) -> str:
    most = max((gpu_count(w.inventory) or 0 for w in workers), default=0)
    return f"tp_size {spec.model.tp_size} needs {spec.model.tp_size} GPUs and no worker has more than {most}"
