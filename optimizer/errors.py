"""Errors raised by the optimizer package.

    OptimizerError
    ├── SpecError            a study spec or configuration breaks a rule (field, message)
    ├── StudyNotFoundError   no study of that name
    ├── StudyExistsError     a study of that name exists already
    └── TrialStateError      the trial cannot take that report (finished, unknown)

The API maps these to HTTP once, in `api.errors`.
"""

from __future__ import annotations


class OptimizerError(Exception):
    """Base of every error the optimizer raises on purpose."""


class SpecError(OptimizerError):
    """A spec or configuration is invalid.  `field` is a dotted path into the spec."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


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
