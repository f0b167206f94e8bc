"""Counted nouns in the sentences spectune prints ("1 baseline", "2 baselines")."""

from __future__ import annotations


def plural(n: int, noun: str, many: str | None = None) -> str:
    """`n` and the noun, singular for exactly one: `plural(1, "baseline")` is "1 baseline"."""
    return f"{n} {noun if n == 1 else (many or noun + 's')}"
