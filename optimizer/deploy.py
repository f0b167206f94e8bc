"""The answer as a server to deploy: the exact SGLang command for the load the user serves.

A trial's server is sized for the benchmark (graphs only for the measured batch sizes, max
running requests = the largest level); deployed like that it would serve 1 or 4 requests at a
time.  The deployed server is sized by the study's `serving` section instead, and without one it
caps nothing below SGLang's own defaults: with speculation SGLang itself caps running requests
at 48 (and graphs at that), so the command says 48; without speculation it leaves both flags to
SGLang (docs/sglang.md "Resolution rules", "CUDA graphs").

Three shapes of answer (`mode`):

* `static`: the winner's steps / topk / draft tokens;
* `adaptive`: SGLang's `--speculative-adaptive` with a per-batch-size config, when the objective
  spans several levels, the per-level winners differ and fit SGLang's adaptive rules
  (`optimizer.answers`);
* `no_speculation`: the verdict is "speculation does not pay here": the same server without it.

Model paths are registry names at the API; the command carries a clearly marked placeholder
unless it is printed where the registry is known (`spectune study best --worker-config`).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from optimizer.answers import ADAPTIVE_FILE, AdaptiveExport
from optimizer.plan import server_settings
from optimizer.sglang import ServerSettings, launch_command
from optimizer.space import SpecConfig
from optimizer.spec import StudySpec

# SGLang's cap on running requests when speculation is on and the flag is absent (docs/sglang.md).
SPEC_DEFAULT_MAX_RUNNING_REQUESTS = 48
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000

Mode = Literal["static", "adaptive", "no_speculation"]


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
    running = max(SPEC_DEFAULT_MAX_RUNNING_REQUESTS, max(spec.workload.concurrency), tuned or 0)
    return base.model_copy(
        update={"max_running_requests": running, "cuda_graph_max_bs": tuned or running, "cuda_graph_bs": None}
    ), True


@dataclass(frozen=True)
class Deployment:
    mode: Mode
    settings: ServerSettings
    pin_max_running_requests: bool
    version: str
    reason: str
    adaptive_config: dict[str, Any] | None = None

    @property
    def speculation(self) -> bool:
        return self.mode != "no_speculation"

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
        extra: list[str] = []
        if self.mode == "adaptive":
            extra = ["--speculative-adaptive", "--speculative-adaptive-config", ADAPTIVE_FILE]
        line = launch_command(
            s,
            version=self.version,
            model_path=models.get(s.target) or placeholder(s.target),
            draft_model_path=None if s.draft is None else models.get(s.draft) or placeholder(s.draft),
            host=host,
            port=port,
            pin_max_running_requests=self.pin_max_running_requests,
            extra=extra,
        )
        if self.adaptive_config is None or self.mode != "adaptive":
            return line
        doc = json.dumps(self.adaptive_config, sort_keys=True)
        return f"cat > {shlex.quote(ADAPTIVE_FILE)} <<'EOF'\n{doc}\nEOF\n{line}"

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
        )


def plan_deployment(
    spec: StudySpec,
    winner: SpecConfig | None,
    *,
    pays: bool,
    exported: AdaptiveExport | None,
    version: str,
) -> Deployment | None:
    """What to deploy for this answer; None before anything was measured."""
    if winner is None:
        return None
    if not pays:
        settings, pin = deployment_settings(spec, None)
        return Deployment(
            "no_speculation",
            settings,
            pin,
            version,
            "speculation does not pay here: the same server without speculation",
        )
    adaptive = _adaptive_steps(spec, exported)
    if adaptive is not None and exported is not None:
        settings, pin = deployment_settings(spec, SpecConfig(num_steps=adaptive, topk=1, num_draft_tokens=adaptive + 1))
        return Deployment(
            "adaptive",
            settings,
            pin,
            version,
            "the best steps differ between concurrency levels: SGLang's adaptive mode switches between them "
            f"by batch size ({exported.reason})",
            exported.config,
        )
    settings, pin = deployment_settings(spec, winner)
    return Deployment("static", settings, pin, version, "the winner's configuration at every load")


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
