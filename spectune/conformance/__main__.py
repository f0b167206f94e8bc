"""`python -m spectune.conformance [--version X ...] [--wheel FILE --version X]` (`make conformance`).

Prints one line per finding and one verdict per version; exit 0 when every version conforms,
1 when any does not, 2 when a wheel cannot be had (the message says how to retry).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from spectune.conformance.checks import check
from spectune.conformance.errors import ConformanceError
from spectune.conformance.source import WheelSource
from spectune.conformance.wheels import fetch
from workers.launcher.supported import SUPPORTED_SGLANG


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spectune.conformance", description=__doc__)
    p.add_argument("--version", action="append", help="check this supported version (repeatable; default: all)")
    p.add_argument("--wheel", type=Path, help="check this wheel file (with one --version: the version it claims)")
    args = p.parse_args(argv)
    versions = args.version or list(SUPPORTED_SGLANG)
    if args.wheel is not None and len(versions) != 1:
        p.error("--wheel needs exactly one --version: the version the wheel is checked as")
    failed = False
    for version in versions:
        if args.wheel is None and version not in SUPPORTED_SGLANG:
            p.error(f"SGLang {version} is not in workers/launcher/supported.py (listed: {', '.join(SUPPORTED_SGLANG)})")
        try:
            wheel = args.wheel if args.wheel is not None else fetch(version)
        except ConformanceError as e:
            sys.stderr.write(f"error: {e}\n")
            return 2
        report = check(version, WheelSource.from_wheel(wheel))
        for line in report.problems:
            sys.stdout.write(f"FAIL {line}\n")
        for line in report.notes:
            sys.stdout.write(f"note {line}\n")
        sys.stdout.write(f"{'ok  ' if report.ok else 'FAIL'} SGLang {version} ({wheel.name})\n")
        failed = failed or not report.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
