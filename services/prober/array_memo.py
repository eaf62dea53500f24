"""A memo of read-only arrays, bounded by their bytes: a pure function's result kept for callers that ask again with
the same inputs (the same bits back, not a recomputation that could differ), least recently used first out."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np


class ArrayMemo:
    """Arrays by key, at most `max_bytes` of them (one larger array is kept alone); thread-safe. `make` runs outside
    the lock, so two threads may both compute a missing entry: the same values, one kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable, make: Callable[[], np.ndarray]) -> np.ndarray:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
        value = make()
        if value.flags.writeable:
            raise ValueError("ArrayMemo keeps read-only arrays only: a caller could change what the next one reads")
        with self._lock:
            if key not in self._items:
                self._items[key] = value
                self._bytes += value.nbytes
            while self._bytes > self.max_bytes and len(self._items) > 1:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.nbytes
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0
