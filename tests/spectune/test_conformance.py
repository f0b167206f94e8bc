"""spectune against the real SGLang: every supported wheel's own source (spectune/conformance/).

The wheels come from PyPI through pip, once, into ~/.cache/spectune/sglang-wheels (verified by
sha256); a failed download fails the test with the command to retry, never skips it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from spectune.conformance.checks import check
from spectune.conformance.errors import WheelError
from spectune.conformance.source import WheelSource
from spectune.conformance.wheels import fetch, sha256_of
from workers.launcher.supported import SUPPORTED_SGLANG

REPO = Path(__file__).resolve().parents[2]
SPEC_FIELDS = "sglang/srt/arg_groups/fields/spec.py"  # where 0.5.23 declares the speculative flags
HOOK = "sglang/srt/arg_groups/speculative_hook.py"


def _source(version: str) -> WheelSource:
    return WheelSource.from_wheel(fetch(version))


@pytest.mark.parametrize("version", list(SUPPORTED_SGLANG))
def test_every_supported_version_conforms(version: str) -> None:
    report = check(version, _source(version))
    assert report.problems == []


def _conformance(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spectune.conformance", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def _copy_with(wheel: Path, dest: Path, member: str, old: str, new: str) -> Path:
    """A copy of `wheel`'s Python source whose `member` has `old` replaced by `new` (once; it must
    be there).  Compiled libraries and data are left out: the checker reads source only."""
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if not info.filename.endswith(".py"):
                continue
            data = src.read(info)
            if info.filename == member:
                text = data.decode()
                assert text.count(old) >= 1, f"{old!r} not in {member}"
                data = text.replace(old, new, 1).encode()
            out.writestr(info, data)
    return dest


@pytest.mark.parametrize(
    ("version", "member", "old", "new", "flag"),
    [
        # 0.5.23 declares fields (`A[...]`), 0.5.13 calls add_argument: both ways are read.
        (
            "0.5.23",
            SPEC_FIELDS,
            "    speculative_num_steps: A[",
            "    speculative_depth: A[",
            "--speculative-num-steps",
        ),
        (
            "0.5.13",
            "sglang/srt/server_args.py",
            '"--cuda-graph-max-bs",',
            '"--cuda-graph-max-batch",',
            "--cuda-graph-max-bs",
        ),
    ],
)
def test_a_wheel_with_a_flag_renamed_fails_naming_that_flag(
    tmp_path: Path, version: str, member: str, old: str, new: str, flag: str
) -> None:
    changed = _copy_with(fetch(version), tmp_path / f"sglang-{version}-renamed.whl", member, old, new)
    done = _conformance("--wheel", str(changed), "--version", version)
    assert done.returncode == 1, done.stdout + done.stderr
    failures = [line for line in done.stdout.splitlines() if line.startswith("FAIL") and flag in line]
    assert failures and "does not exist" in failures[0]
    # The untouched wheel passes through the same command.
    assert _conformance("--version", version).returncode == 0


def test_an_old_flag_name_is_an_ambiguous_abbreviation_on_the_modern_parser() -> None:
    # 0.5.23's parser given the argv spectune builds for 0.5.13 (old CUDA-graph names).
    report = check("0.5.13", _source("0.5.23"))
    ambiguous = [p for p in report.problems if p.startswith("SGLang 0.5.13: --cuda-graph-max-bs is an ambiguous")]
    assert ambiguous and "--cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill" in ambiguous[0]


def test_a_changed_default_is_named() -> None:
    src = _source("0.5.23")
    files = dict(src.files)
    files[HOOK] = files[HOOK].replace("max_running_requests=48", "max_running_requests=64")
    files[HOOK] = files[HOOK].replace(
        "speculative_num_draft_tokens=cfg.speculative_num_steps + 1",
        "speculative_num_draft_tokens=cfg.speculative_num_steps + 2",
    )
    problems = check("0.5.23", WheelSource(files)).problems
    assert any("max_running_requests = 48 (found [64])" in p for p in problems), problems
    assert any("speculative_num_steps + 1" in p for p in problems), problems


def test_a_study_extra_flag_that_changed_kind_is_named() -> None:
    src = _source("0.5.23")
    memory, schedule = "sglang/srt/arg_groups/fields/memory.py", "sglang/srt/arg_groups/fields/schedule.py"
    files = dict(src.files)
    files[memory] = files[memory].replace(
        "    disable_radix_cache: A[\n        bool,", "    disable_radix_cache: A[\n        str,"
    )
    files[schedule] = files[schedule].replace(
        "    chunked_prefill_size: A[\n        Optional[int],", "    chunked_prefill_size: A[\n        Optional[float],"
    )
    problems = check("0.5.23", WheelSource(files)).problems
    assert any(p.startswith("SGLang 0.5.23: extra flag --disable-radix-cache is 'value'") for p in problems), problems
    assert any(p.startswith("SGLang 0.5.23: extra flag --chunked-prefill-size wants float") for p in problems), problems


def test_a_changed_adaptive_schema_is_named() -> None:
    src = _source("0.5.23")
    adaptive = "sglang/srt/speculative/adaptive_spec_params.py"
    files = dict(src.files)
    files[adaptive] = files[adaptive].replace("isinstance(s, int) and s >= 0", "isinstance(s, int) and s >= 2")
    assert check("0.5.23", WheelSource(files)).problems  # a bound spectune cannot meet
    files[adaptive] = src.files[adaptive].replace('entry.get("candidate_steps")', 'entry.get("steps")')
    problems = check("0.5.23", WheelSource(files)).problems
    assert any("candidate_steps" in p for p in problems), problems


def test_a_fresh_cache_downloads_and_a_corrupt_file_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    version = "0.5.13"  # the smallest supported wheel
    # pip itself downloads into the empty cache; its index is the shared cache's folder, so this
    # runs offline too once the wheels are cached (the first test on a fresh machine fetched it
    # from PyPI).
    listed = fetch(version)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(listed.parent))
    fresh = tmp_path / "cache"
    wheel = fetch(version, cache=fresh)
    assert wheel.parent == fresh and sha256_of(wheel) == SUPPORTED_SGLANG[version].sha256
    wheel.write_bytes(b"not a wheel")
    assert sha256_of(fetch(version, cache=fresh)) == SUPPORTED_SGLANG[version].sha256
    assert [p.name for p in fresh.iterdir()] == [wheel.name]  # no download folders left behind


def test_a_failed_download_says_how_to_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An index nobody listens on (loopback, a closed port), no other source, no retries.
    for name, value in {
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
        "PIP_CONFIG_FILE": os.devnull,
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(WheelError) as info:
        fetch("0.5.13", cache=tmp_path)
    message = str(info.value)
    assert "could not download SGLang 0.5.13" in message and "-m spectune.conformance --version 0.5.13" in message
    assert "\n" not in message
