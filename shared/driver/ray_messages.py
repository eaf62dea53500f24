"""Ray's own messages (raylet errors pushed to the driver) as a log reader wants them: plain, one line each.

The driver prints a lost worker or node as one progress line of its own (JobRetried); Ray prints the same event
as a multi-line, colour-coded traceback per failed call, repeated per retry. In a log that is not a terminal,
each such message is cut to its first line without colour codes, and a message already shown is not repeated.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import Any, TextIO

from poolbench.errors import without_colours

_IDS = re.compile(r"\b[0-9a-f]{16,}\b|\b\d+\b")


def message_kind(line: str) -> str:
    """A message's first line with ids and numbers blanked: two retries of one failure are one kind."""
    return _IDS.sub("#", line)


def plain_ray_messages(stream: TextIO | None = None) -> None:
    """When `stream` (stdout) is not a terminal: no colour prefixes on Ray's lines and raylet messages cut to one
    line, each kind once. Call before ray.init; Ray reads RAY_COLOR_PREFIX and its printer each time it prints."""
    stream = stream or sys.stdout
    if stream.isatty():
        return
    os.environ["RAY_COLOR_PREFIX"] = "0"
    import ray._private.ray_logging as ray_logging
    import ray._private.worker as ray_worker

    ray_logging._color = lambda message: message  # " [repeated 3x across cluster]" is green whatever the setting

    original: Callable[..., Any] = getattr(ray_worker, "print_to_stdstream", None) or (lambda *a, **k: None)
    if getattr(original, "__poolbench_plain__", False):
        return
    seen: set[str] = set()

    def print_plain(data: dict, *args: Any, **kwargs: Any) -> None:
        if data.get("pid") != "raylet":
            return original(data, *args, **kwargs)
        lines = []
        for message in data.get("lines", []):
            first = next((line.strip() for line in without_colours(message).splitlines() if line.strip()), "")
            if first and message_kind(first) not in seen:
                seen.add(message_kind(first))
                lines.append(first)
        if lines:
            original({**data, "lines": lines}, *args, **kwargs)
        return None

    print_plain.__poolbench_plain__ = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_plain
