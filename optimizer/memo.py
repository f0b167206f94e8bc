"""The last value computed for each study, kept while what it was computed from is unchanged.

The study document, the conductor and the benchmarks ask the same questions of a study many
times between two results (the stop rule, the ranking of candidates); each answer is a model fit.
Keyed by study name, checked against a fingerprint of the inputs (the spec and the finished
trials), bounded (the least recently computed goes first) and safe to share between request threads.
The computation runs outside the lock: two threads may both compute, the later one is kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class PerStudyMemo(Generic[T]):
    def __init__(self, most: int) -> None:
        self._most = most
        self._lock = threading.Lock()
        self._last: OrderedDict[str, tuple[Hashable, T]] = OrderedDict()

    def get(self, study: str, inputs: Hashable, compute: Callable[[], T]) -> T:
        with self._lock:
            hit = self._last.get(study)
        if hit is not None and hit[0] == inputs:
            return hit[1]
        value = compute()
        with self._lock:
            self._last[study] = (inputs, value)
            self._last.move_to_end(study)
            while len(self._last) > self._most:
                self._last.popitem(last=False)
        return value
