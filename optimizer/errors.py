"""Errors raised by the optimizer package.

    SpecError                a study spec or configuration breaks a rule (field, message);
                             the wire package's (spectune_protocol.errors): SpecConfig's rules raise it
    OptimizerError
    ├── StudyNotFoundError   no study of that name
    ├── StudyExistsError     a study of that name exists already
    └── TrialStateError      the trial cannot take that report (finished, unknown)

The API maps these to HTTP once, in `api.errors`.
"""

from __future__ import annotations

from spectune_protocol.errors import SpecError as SpecError


class OptimizerError(Exception):
    """Base of every error the optimizer raises on purpose."""


class StudyNotFoundError(OptimizerError):
    def __init__(self, name: str) -> None:
        super().__init__(f"no study named {name!r}")
        self.name = name


class StudyExistsError(OptimizerError):
    def __init__(self, name: str) -> None:
        super().__init__(f"a study named {name!r} exists already; pick another name")
        self.name = name


class TrialStateError(OptimizerError):
    """The trial is not in a state that accepts this operation."""
