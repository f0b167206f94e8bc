"""A worker checks itself before it takes work: the engine imports, the GPUs are the configured ones."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from workers.errors import ConfigError
from workers.gpu import GpuDevice, GpuProcess
from workers.preflight import check_engine_imports, check_gpus


def _env(path: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(path)}


def _engine_package(root: Path, main_imports: str) -> Path:
    pkg = root / "fake_engine"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    # If the check ran __main__ instead of reading its imports, this file would appear.
    (pkg / "__main__.py").write_text(f"{main_imports}\nopen({str(root / 'ran')!r}, 'w').close()\n")
    return root


def test_engine_package_whose_main_imports_a_missing_module_is_refused(tmp_path: Path) -> None:
    root = _engine_package(tmp_path, "import sys\nfrom no_such_dependency_xyz import serve")
    with pytest.raises(ConfigError) as e:
        check_engine_imports(sys.executable, "fake_engine", env=_env(root))
    msg = str(e.value)
    assert "\n" not in msg and "no_such_dependency_xyz" in msg and "engine.module: fake_engine" in msg
    assert not (root / "ran").exists()  # __main__ was read, never run


def test_engine_package_with_its_dependencies_passes_without_running(tmp_path: Path) -> None:
    root = _engine_package(tmp_path, "import json\nfrom os import path")
    check_engine_imports(sys.executable, "fake_engine", env=_env(root))
    assert not (root / "ran").exists()


def test_engine_module_missing_from_the_interpreter_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no_such_engine_module does not import .*No module named"):
        check_engine_imports(sys.executable, "no_such_engine_module", env=_env(tmp_path))
    with pytest.raises(ConfigError, match="engine.python: cannot run"):
        check_engine_imports(str(tmp_path / "nope" / "python"), "json", env=_env(tmp_path))


class _Probe:
    def __init__(self, indices: list[int]) -> None:
        self.indices = indices

    def devices(self) -> list[GpuDevice]:
        return [
            GpuDevice(index=i, name="NVIDIA H200", uuid=f"GPU-{i}", memory_total_mib=143771, memory_used_mib=0)
            for i in self.indices
        ]

    def compute_processes(self) -> list[GpuProcess]:
        return []

    def driver_version(self) -> str | None:
        return "560.35"


def test_gpu_count_must_match_what_nvml_sees() -> None:
    check_gpus(_Probe([0, 1, 2, 3]), [0, 1], {})
    check_gpus(_Probe([0, 1]), None, {"gpu_count": "2"})
    check_gpus(None, [0, 1, 2, 3, 4, 5, 6, 7], {})  # no driver: nothing to compare (simulated engine)
    with pytest.raises(ConfigError, match=r"gpus: GPU index\(es\) \[4, 5\] are not on this host"):
        check_gpus(_Probe([0, 1, 2, 3]), [0, 1, 4, 5], {})
    with pytest.raises(ConfigError, match="labels.gpu_count: the config says 8 but this worker may use 2"):
        check_gpus(_Probe([0, 1]), None, {"gpu_count": "8"})
