"""The SGLang launcher: build the server's argv for the installed version, run it, stop it cleanly.

EngineConfig, detect_sglang_version, build_argv      what to run
Launcher, RunningServer                              running it (one server at a time)
classify_exit                                        why a server died
"""

from workers.launcher.argv import build_argv
from workers.launcher.classify import classify_exit
from workers.launcher.config import EngineConfig, server_env
from workers.launcher.launcher import Launcher, RunningServer
from workers.launcher.version import detect_sglang_version

__all__ = [
    "EngineConfig",
    "Launcher",
    "RunningServer",
    "build_argv",
    "classify_exit",
    "detect_sglang_version",
    "server_env",
]
