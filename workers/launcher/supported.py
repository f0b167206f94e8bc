"""The SGLang versions spectune supports: the one list the worker's version gate and the
conformance check (`make conformance`, spectune/conformance/) both read.

A version is here only when `make conformance` passed on its wheel: every flag spectune emits,
the defaults it relies on and the adaptive config's schema were read from that wheel's own source
(docs/sglang.md "Conformance").  The hashes are the sha256 of the wheels on PyPI (the cp311,
manylinux_2_34_x86_64 build, which spectune/conformance/wheels.py asks pip for on any
interpreter), so the check always reads exactly the file that passed here.

To add a release: add its line (`pip download --no-deps sglang==X` and `sha256sum` the wheel),
run `make conformance`, and fix what it names before committing.
"""

from __future__ import annotations

from typing import NamedTuple

from optimizer.sglang import parse_version


class Wheel(NamedTuple):
    filename: str
    sha256: str


# Every release from 0.5.13 (the oldest line optimizer/sglang.py has flags for) to 0.5.23.
SUPPORTED_SGLANG: dict[str, Wheel] = {
    "0.5.13": Wheel(
        "sglang-0.5.13-cp311-cp311-manylinux_2_34_x86_64.whl",
        "9d26266ab7e99165098f9e173f4a5a0ef6a0b64a6f30ef0b5ee859eead37e75a",
    ),
    "0.5.13.post1": Wheel(
        "sglang-0.5.13.post1-cp311-cp311-manylinux_2_34_x86_64.whl",
        "1c1653ecf2893c7d7b1cf0c3e1cc9b7550ebad95c809de2f44bcc91b7a1e1fe3",
    ),
    "0.5.14": Wheel(
        "sglang-0.5.14-cp311-cp311-manylinux_2_34_x86_64.whl",
        "4fe16056b45c8aca00f5f90ceb174dc3a62a3f5dccf159c791370795cd00fc99",
    ),
    "0.5.15": Wheel(
        "sglang-0.5.15-cp311-cp311-manylinux_2_34_x86_64.whl",
        "21492759b4b99e117bd81610f633422f3fdae2896c2cde6931eab886deccc44f",
    ),
    "0.5.15.post1": Wheel(
        "sglang-0.5.15.post1-cp311-cp311-manylinux_2_34_x86_64.whl",
        "8e182e1c449197cb6f98716a7cf432a3ea7af78c172f9b840ab28ad9e6cda9b4",
    ),
    "0.5.16": Wheel(
        "sglang-0.5.16-cp311-cp311-manylinux_2_34_x86_64.whl",
        "d5f345a18953dd35df568ac56bdcb7f5ee910ab39efea4469b714556d1070713",
    ),
    "0.5.17": Wheel(
        "sglang-0.5.17-cp311-cp311-manylinux_2_34_x86_64.whl",
        "575e38f5683624ded3b4bb267f637a098e5ed37d13a1d1ff5ea09bd781a04d16",
    ),
    "0.5.18": Wheel(
        "sglang-0.5.18-cp311-cp311-manylinux_2_34_x86_64.whl",
        "e97b585dd2d5db2802599feba47c84cce972f5e1231a6816fef996200207b5cf",
    ),
    "0.5.19": Wheel(
        "sglang-0.5.19-cp311-cp311-manylinux_2_34_x86_64.whl",
        "425e87377e725d03db8262382008f3fd9561a6cf5d82f485f8b9929f02ffe12b",
    ),
    "0.5.20": Wheel(
        "sglang-0.5.20-cp311-cp311-manylinux_2_34_x86_64.whl",
        "1573527042f4f6b4ead838302818595fc77fdc611dbcc2e40cd150fbc8f8513c",
    ),
    "0.5.21": Wheel(
        "sglang-0.5.21-cp311-cp311-manylinux_2_34_x86_64.whl",
        "96c029f75dec99baa33a5db3d41b1bebefdd6bcfba3a2f7c807fe1cf49a87c20",
    ),
    "0.5.22": Wheel(
        "sglang-0.5.22-cp311-cp311-manylinux_2_34_x86_64.whl",
        "cc9a0f15bd8f877a0584fdb7a1702240177a1f1cc8d17c978715161717b9037b",
    ),
    "0.5.23": Wheel(
        "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
        "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
    ),
}

CONFORMANCE_COMMAND = "make conformance"


def normalized(version: str) -> str:
    """The version as PyPI spells it: no leading "v", no surrounding blanks."""
    return version.strip().lstrip("v")


def unsupported_reason(version: str) -> str | None:
    """One line saying why spectune refuses SGLang `version`, or None when it is supported."""
    v = normalized(version)
    if v in SUPPORTED_SGLANG:
        return None
    try:
        newer = parse_version(v) > max(parse_version(k) for k in SUPPORTED_SGLANG)
    except ValueError:
        newer = False
    listed = ", ".join(SUPPORTED_SGLANG)
    what = "newer than any version spectune was checked against" if newer else "not one spectune supports"
    return (
        f"SGLang {v} is {what} (supported: {listed}); install one of those, or add {v} with its wheel's "
        f"sha256 to workers/launcher/supported.py and run `{CONFORMANCE_COMMAND}` to check it against its source"
    )
