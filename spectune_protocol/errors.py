"""The one error the wire's own rules raise (optimizer.errors re-exports it in its hierarchy's place)."""

from __future__ import annotations


class SpecError(Exception):
    """A spec or configuration is invalid.  `field` is a dotted path into the spec.

    Not a ValueError: raised inside a pydantic validator it would be turned into a validation
    error, and the API answers this one itself, naming the field (api.errors)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
