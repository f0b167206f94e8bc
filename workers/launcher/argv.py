"""The server's argv: interpreter, module, and the flags optimizer.sglang builds for this version."""

from __future__ import annotations

from optimizer.sglang import ServerSettings, build_server_args
from workers.launcher.config import EngineConfig


def build_argv(
    engine: EngineConfig,
    settings: ServerSettings,
    *,
    version: str,
    model_path: str,
    draft_model_path: str | None,
    adaptive_config_path: str | None = None,
) -> list[str]:
    """`[python, "-m", module, *flags]`; run as a list, never through a shell.

    `adaptive_config_path`: the file the launcher wrote an adaptive server's config to.
    """
    flags = build_server_args(
        settings,
        version=version,
        model_path=model_path,
        draft_model_path=draft_model_path,
        host=engine.host,
        port=engine.port,
        adaptive_config_path=adaptive_config_path,
    )
    return [engine.python, "-m", engine.module, *flags]
