"""The answer as a server to deploy: the exact SGLang command for the load the user serves.

A trial's server is sized for the benchmark (graphs only for the measured batch sizes, max
running requests = the largest level).  The deployed server is sized by the study's `serving`
section, whose envelope the trials run with too.  Without one, the command admits only what
was measured (issue 17 item 3): with speculation it is sized to the measured loads (at most the
largest measured concurrency running, CUDA graphs up to it), and says so, because SGLang's own
default with speculation (48 running requests, graphs up to 48) would serve batches nobody
measured, where speculation may lose (verify cost grows with batch x draft tokens).  Without
speculation there is nothing to prove: both flags stay SGLang's (docs/sglang.md "Resolution
rules", "CUDA graphs").  Every answer states the load range it was proven on.

Three shapes of answer (`mode`):

* `static`: the winner's steps / topk / draft tokens;
* `adaptive`: SGLang's `--speculative-adaptive` with a per-batch-size config, when the objective
  spans several levels, the per-level winners differ and fit SGLang's adaptive rules
  (`optimizer.answer`); also when no single configuration pays over every level but a chain
  pays at some: speculation there, steps 0 where it does not pay;
* `no_speculation`: the verdict is "speculation does not pay here": the same server without it.

Model paths are registry names at the API; the command carries a clearly marked placeholder
unless it is printed where the registry is known (`spectune study best --worker-config`).
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from optuna.trial import FrozenTrial

from optimizer.answer import ADAPTIVE_FILE, AdaptiveExport
from optimizer.memory_boundary import Launch, MemoryBoundary, Terms, tuning_launches
from optimizer.plan import server_settings
from optimizer.policy import DEFAULT_POLICY, Policy
from optimizer.sglang import AdaptiveSteps, ServerSettings, launch_command
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec
from optimizer.words import plural

# SGLang's cap on running requests when speculation is on and the flag is absent (docs/sglang.md).
SPEC_DEFAULT_MAX_RUNNING_REQUESTS = 48
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000

Mode = Literal["static", "adaptive", "no_speculation"]
# The configuration key of the launch that proves an adaptive answer (one server, several chains).
ADAPTIVE_KEY = "adaptive"
# The event of an adaptive deployment that did not start (the answer falls back to what was proven).
ADAPTIVE_FAILED = "adaptive_failed"


def placeholder(name: str) -> str:
    """A model path that cannot be mistaken for a real one (the server refuses it at once)."""
    return f"<local path of {name}>"


def deployment_settings(spec: StudySpec, config: SpecConfig | None) -> tuple[ServerSettings, bool]:
    """The production server for `config` (None: without speculation), and whether to pin max running requests."""
    base = server_settings(spec, config)
    tuned = config.cuda_graph_max_bs if config is not None else None
    if spec.serving is not None:
        running = spec.serving.max_running_requests
        graphs = spec.serving.max_batch or tuned or running
        return base.model_copy(
            update={"max_running_requests": running, "cuda_graph_max_bs": min(graphs, running), "cuda_graph_bs": None}
        ), True
    if config is None:
        # No speculation, no envelope: SGLang sizes both from GPU memory; pinning anything would cap it.
        return base.model_copy(update={"cuda_graph_max_bs": None, "cuda_graph_bs": None}), False
    # No envelope: admit only the loads measured (see the module docstring).
    running = max(max(spec.workload.concurrency), tuned or 0)
    return base.model_copy(
        update={"max_running_requests": running, "cuda_graph_max_bs": tuned or running, "cuda_graph_bs": None}
    ), True


def load_note(spec: StudySpec, speculation: bool) -> str:
    """The load range an answer was proven on, and what the command admits beyond it."""
    levels = ", ".join(map(str, spec.workload.concurrency))
    proven = f"proven at concurrency {levels}"
    if not speculation:
        return proven
    if spec.serving is not None:
        return f"{proven}, on servers with the serving envelope ({plural(spec.serving.max_running_requests, 'running request')})"
    top = max(spec.workload.concurrency)
    return (
        f"{proven}; no serving section, so the command admits at most {plural(top, 'running request')}, the most the "
        f"study measured (SGLang's default with speculation, {SPEC_DEFAULT_MAX_RUNNING_REQUESTS}, would run "
        "batches nobody measured); add serving.max_running_requests to the spec to tune for more"
    )


@dataclass(frozen=True)
class Deployment:
    mode: Mode
    settings: ServerSettings
    pin_max_running_requests: bool
    version: str
    reason: str
    adaptive_config: dict[str, Any] | None = None
    # The levels it was measured at, and what the command admits beyond them (`load_note`).
    proven_levels: tuple[int, ...] = ()
    load_note: str = ""
    # The launch that started exactly this server (a confirmation lease), and how it differs
    # from the envelope planned first (a smaller graph envelope after an out-of-memory start).
    proven_by: str | None = None
    proof_note: str = ""

    def proven(self, lease_id: str, settings: ServerSettings, note: str) -> Deployment:
        """This deployment as a confirmation launched it: its server, named by that launch."""
        reason = self.reason if not note else f"{self.reason}; {note}"
        return dataclasses.replace(self, settings=settings, proven_by=lease_id, proof_note=note, reason=reason)

    @property
    def speculation(self) -> bool:
        return self.mode != "no_speculation"

    def load_line(self) -> str:
        """The line printed right above the command: the loads it was proven at and what it
        admits, read from the server it runs (a command proven at concurrency 1 that admits one
        running request serves one user at a time, and must say so where it is copied from)."""
        levels = ", ".join(map(str, self.proven_levels)) or "no measured level"
        if self.pin_max_running_requests:
            admits = f"admits at most {plural(self.settings.max_running_requests, 'running request')}"
        else:
            admits = "admits as many running requests as SGLang sizes from GPU memory (nothing pinned)"
        return f"proven at concurrency {levels}; {admits}"

    def command(
        self,
        *,
        models: Mapping[str, str] | None = None,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
    ) -> str:
        """The shell text to run: the server line, after writing the adaptive config when there is one.

        `models` maps registry names to local paths (a worker's registry); a name it lacks is a placeholder.
        """
        models = models or {}
        s = self.settings
        line = launch_command(
            s,
            version=self.version,
            model_path=models.get(s.target) or placeholder(s.target),
            draft_model_path=None if s.draft is None else models.get(s.draft) or placeholder(s.draft),
            host=host,
            port=port,
            pin_max_running_requests=self.pin_max_running_requests,
            adaptive_config_path=None if s.adaptive is None else ADAPTIVE_FILE,
        )
        if s.adaptive is None:
            return line
        # The file's text is the one a worker writes for the launch that proves this command.
        return f"cat > {shlex.quote(ADAPTIVE_FILE)} <<'EOF'\n{s.adaptive.config_text()}\nEOF\n{line}"

    def as_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "speculation": self.speculation,
            "reason": self.reason,
            "sglang_version": self.version,
            "server": self.settings.model_dump(mode="json"),
            "pin_max_running_requests": self.pin_max_running_requests,
            "adaptive_config": self.adaptive_config,
            "adaptive_file": ADAPTIVE_FILE if self.mode == "adaptive" else None,
            "proven_levels": list(self.proven_levels),
            "load_note": self.load_note,
            "load_line": self.load_line(),
            # The confirmation lease that started exactly this server (None: no launch did).
            "proven_by": self.proven_by,
            "proof_note": self.proof_note,
            # Placeholders for model paths; `spectune study best --worker-config` fills them in.
            "launch_command": self.command(),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Deployment:
        return cls(
            mode=doc["mode"],
            settings=ServerSettings.model_validate(doc["server"]),
            pin_max_running_requests=bool(doc["pin_max_running_requests"]),
            version=str(doc["sglang_version"]),
            reason=str(doc.get("reason") or ""),
            adaptive_config=doc.get("adaptive_config"),
            proven_levels=tuple(int(c) for c in doc.get("proven_levels") or ()),
            load_note=str(doc.get("load_note") or ""),
            proven_by=doc.get("proven_by"),
            proof_note=str(doc.get("proof_note") or ""),
        )


def plan_deployment(
    spec: StudySpec,
    winner: SpecConfig | None,
    *,
    pays: bool,
    exported: AdaptiveExport | None,
    version: str,
) -> Deployment | None:
    """What to deploy for this answer; None before anything was measured.

    Without a configuration that pays over every level, a chain that pays at some levels is
    deployed adaptively (steps 0 at the others); only when none pays anywhere is the answer the
    server without speculation.
    """
    if winner is None:
        return None
    levels = tuple(spec.workload.concurrency)
    adaptive = _adaptive_steps(spec, exported)
    if adaptive is not None and exported is not None and exported.config is not None:
        settings, pin = adaptive_settings(spec, exported)
        off = sorted(int(k) for k, v in exported.config.items() if v["candidate_steps"] == [0])
        if pays:
            reason = (
                "the best steps differ between concurrency levels: SGLang's adaptive mode switches between them "
                f"by batch size ({exported.reason})"
            )
        else:
            on = sorted(int(k) for k in exported.config if int(k) not in off)
            reason = (
                f"no configuration pays over every level, but speculation pays at concurrency "
                f"{', '.join(map(str, on))}: SGLang's adaptive mode drafts there and switches speculation off "
                f"(steps 0) at {', '.join(map(str, off))} ({exported.reason})"
            )
        return Deployment(
            "adaptive", settings, pin, version, reason, exported.config, levels, load_note(spec, speculation=True)
        )
    if not pays:
        settings, pin = deployment_settings(spec, None)
        return Deployment(
            "no_speculation",
            settings,
            pin,
            version,
            "speculation does not pay here: the same server without speculation",
            None,
            levels,
            load_note(spec, speculation=False),
        )
    settings, pin = deployment_settings(spec, winner)
    return Deployment(
        "static",
        settings,
        pin,
        version,
        "the winner's configuration at every measured load",
        None,
        levels,
        load_note(spec, speculation=True),
    )


def adaptive_settings(spec: StudySpec, exported: AdaptiveExport) -> tuple[ServerSettings, bool]:
    """The adaptive deployment's server: the envelope of its initial chain, with the per-batch steps."""
    steps = _adaptive_steps(spec, exported)
    assert steps is not None and exported.config is not None
    settings, pin = deployment_settings(spec, SpecConfig(num_steps=steps, topk=1, num_draft_tokens=steps + 1))
    adaptive = AdaptiveSteps.from_config(exported.config)
    return ServerSettings.model_validate({**settings.model_dump(), "adaptive": adaptive.model_dump()}), pin


def adaptive_plan(spec: StudySpec, exported: AdaptiveExport | None) -> ServerSettings | None:
    """The server of the study's adaptive answer, or None when the answer is not adaptive."""
    if exported is None or _adaptive_steps(spec, exported) is None:
        return None
    return adaptive_settings(spec, exported)[0]


def _adaptive_steps(spec: StudySpec, exported: AdaptiveExport | None) -> int | None:
    """The initial steps of an adaptive deployment, or None when a static one is the answer.

    Adaptive only for an objective over several levels (one named level is answered by its own
    winner), only when the per-level winners themselves fit SGLang's rules and differ.
    """
    if spec.objective.concurrency is not None or exported is None or not exported.fits or not exported.config:
        return None
    steps = {int(v["candidate_steps"][0]) for v in exported.config.values()}
    if len(steps) < 2:
        return None
    args = exported.server_args
    return int(args[args.index("--speculative-num-steps") + 1])


# ---------------------------------------------------------------------------------------------
# Proving the command: the envelopes a confirmation launches (issue 17 items 1-2)


@dataclass(frozen=True)
class Envelope:
    """One server a confirmation may launch to prove a configuration's deployment."""

    settings: ServerSettings
    note: str  # how it differs from the printed envelope ("" for the printed one itself)


def deployment_envelopes(spec: StudySpec, config: SpecConfig) -> list[Envelope]:
    """The deployments to try for `config`, the printed one first, then smaller graph envelopes
    (`graph_envelopes`; none when the configuration pins its own graph sizes)."""
    printed, _ = deployment_settings(spec, config)
    return graph_envelopes(spec, printed, pinned=config.cuda_graph_max_bs is not None)


def graph_envelopes(spec: StudySpec, printed: ServerSettings, *, pinned: bool = False) -> list[Envelope]:
    """`printed`, then the smaller graph envelopes a deployment of it may fall back to.

    A smaller graph envelope only where the serving envelope leaves it to us: with
    `serving.max_batch` set (or `pinned`) the captured sizes are the user's, so there is nothing
    to lower.  Smaller means graphs up to the largest measured level (the sizes the study
    measured), then only the measured levels themselves (the tuning envelope, which started in
    the search).  Max running requests never changes: it is the load the user asked to serve.
    """
    out = [Envelope(printed, "")]
    if pinned or (spec.serving is not None and spec.serving.max_batch is not None):
        return out
    top = max(spec.workload.concurrency)
    if printed.cuda_graph_max_bs is not None and printed.cuda_graph_max_bs > top:
        out.append(
            Envelope(
                printed.model_copy(update={"cuda_graph_max_bs": top}),
                f"CUDA graphs up to batch {top} (the largest measured level) instead of "
                f"{printed.cuda_graph_max_bs}: larger batches run without graphs",
            )
        )
    levels = tuple(spec.workload.concurrency)
    out.append(
        Envelope(
            printed.model_copy(update={"cuda_graph_max_bs": top, "cuda_graph_bs": levels}),
            f"CUDA graphs only for the measured batch sizes {', '.join(map(str, levels))}: other batches are "
            "padded up to the next of them, or run without graphs above",
        )
    )
    return out


def smaller_envelope(spec: StudySpec, settings: ServerSettings) -> Envelope | None:
    """The next smaller graph envelope after a deployment in `settings` did not start (the
    adaptive answer's retry; a static candidate's go by tier, `envelopes_to_try`), or None when
    the serving envelope leaves none smaller."""
    return next((e for e in graph_envelopes(spec, settings)[1:] if e.settings != settings), None)


def envelopes_to_try(
    spec: StudySpec,
    config: SpecConfig,
    failed: Sequence[tuple[SpecConfig, int]] = (),
    trials: Sequence[FrozenTrial] = (),
    policy: Policy = DEFAULT_POLICY,
) -> list[tuple[int, Envelope]]:
    """`deployment_envelopes` with what earlier launches taught: (tier, envelope) to launch in order.

    `failed`: (configuration, tier) of deployments that ran out of memory.  A tier is skipped
    for `config` when a configuration needing no more graph memory in it failed there: no more
    draft tokens (target verify and draft extend graphs) and no more steps x topk (draft decode
    graphs), as `optimizer.infeasible` reasons for the search.  It is skipped too when the memory
    model learnt from those failures and the search's launches (`trials`; optimizer.memory_boundary,
    in the deployment's terms) says it surely runs out of memory (the study's `policy.surely`) and a
    smaller envelope is left: the envelope launched instead says which was not launched, and why.  The last
    envelope left is never skipped on the model's word alone.
    """
    c = config.canonical()
    out = []
    for tier, env in enumerate(deployment_envelopes(spec, config)):
        beaten = any(
            t == tier
            and f.canonical().num_draft_tokens <= c.num_draft_tokens
            and f.canonical().num_steps * f.canonical().topk <= c.num_steps * c.topk
            for f, t in failed
        )
        if not beaten:
            out.append((tier, env))
    if len(out) < 2:
        return out
    boundary = MemoryBoundary.fit([*tuning_launches(spec, trials), *deployment_launches(spec, failed)], policy)
    if boundary is None:
        return out
    skipped: list[str] = []
    while len(out) > 1:
        tier, env = out[0]
        terms = Terms.of(env.settings, config)
        j = boundary.judge(terms)
        if j.p_fail < policy.surely:
            break
        what = env.note or f"the printed envelope ({terms.describe()})"
        skipped.append(f"{what} was not launched ({j.p_fail:.0%} sure to run out of memory: {j.reason})")
        out.pop(0)
    if skipped:
        tier, env = out[0]
        out[0] = (tier, Envelope(env.settings, "; ".join([env.note, *skipped])))
    return out


def deployment_launches(spec: StudySpec, failed: Sequence[tuple[SpecConfig, int]]) -> list[Launch]:
    """Deployments that ran out of memory, each in the envelope it was launched in."""
    out = []
    for f, tier in failed:
        envs = deployment_envelopes(spec, f)
        if not 0 <= tier < len(envs):
            continue
        env = envs[tier]
        terms = Terms.of(env.settings, f)
        c = f.canonical()
        where = env.note.split(":")[0] if env.note else f"the printed envelope, {terms.describe()}"
        out.append(Launch(terms, False, f"the deployment of {c.num_steps}/{c.topk}/{c.num_draft_tokens} ({where})"))
    return out


def deployment_failure(kind: str, message: str) -> str:
    """Why a deployment did not start, in the user's terms (OOM at graph capture, KV pool, time-out)."""
    text = message.lower()
    if kind == "oom":
        if "graph" in text or "capture" in text:
            where = "out of GPU memory while capturing CUDA graphs"
        elif "kv" in text or "token_to_kv_pool" in text or "memory pool" in text:
            where = "out of GPU memory for the KV cache pool"
        else:
            where = "out of GPU memory at start-up"
    elif kind == "launch_timeout":
        where = "did not become ready before the start-up time-out"
    else:
        where = f"failed to start ({kind})"
    return where
