"""Errors of the conformance check (spectune/conformance/)."""

from __future__ import annotations


class ConformanceError(Exception):
    """Base of every error the conformance check raises on purpose."""


class WheelError(ConformanceError):
    """An SGLang wheel could not be downloaded or is not the listed file."""
