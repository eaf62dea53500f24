"""Wait on a condition itself, never on a guessed sleep: poll until it holds; fail only after a generous deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str, within_s: float = 120.0, every_s: float = 0.02) -> T:
    """The first truthy value of `condition()`; AssertionError naming `what` if none came within `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within_s} s waiting for {what}")
        time.sleep(every_s)
