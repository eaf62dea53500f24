"""Progress for a log, not a terminal: plain lines a CI log can follow (no bars, no carriage returns, no colour).

`LineProgress` answers the part of rich's `Progress` the run display uses (add_task, update, console.print), so the
same event handler drives either. A stage prints a line when its count crosses each `step_pct` and when it ends,
with counts, elapsed time and an ETA; in-between details print at most every `detail_every_s` seconds.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

_MARKUP = re.compile(r"\[/?[a-z #0-9_.-]*\]")


@dataclass
class _Stage:
    name: str
    total: int
    started: float
    done: int = 0
    last: str = ""
    printed_bucket: int = 0
    detail_at: float = field(default=float("-inf"))
    first_at: float | None = None  # when the first item was done, and how many it was
    first_done: int = 0


class PlainConsole:
    """`console.print` for a plain stream: the text only, rich markup removed, never wrapped."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def print(self, *objects: Any, markup: bool | None = None, **_: Any) -> None:
        """markup=False (as rich's own) keeps the text as it is: "layers [17]" is a list, not a tag to strip."""
        text = " ".join(str(o) for o in objects)
        self.stream.write((text if markup is False else _MARKUP.sub("", text)) + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.0f}s" if seconds < 90 else f"{seconds / 60:.1f}min"


def _remaining(stage: _Stage, now: float) -> float:
    """Seconds left at the rate since the stage's first item was done: a stage whose work starts long after it is
    announced (on CPU the probe tasks wait for the last pooling job) is not timed from the announcement; before a
    second item, at the rate since the announcement."""
    left = stage.total - stage.done
    if stage.first_at is not None and stage.done > stage.first_done and now > stage.first_at:
        return (now - stage.first_at) / (stage.done - stage.first_done) * left
    return (now - stage.started) / stage.done * left


class LineProgress:
    """A stand-in for rich's Progress when stdout is not a terminal."""

    def __init__(self, stream: IO[str], *, step_pct: int = 10, detail_every_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.console = PlainConsole(stream)
        self.step_pct = step_pct
        self.detail_every_s = detail_every_s
        self.clock = clock
        self._stages: list[_Stage] = []

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def add_task(self, description: str, total: int | None = None, **fields: Any) -> int:
        self._stages.append(_Stage(description, int(total or 0), self.clock(), last=str(fields.get("last", ""))))
        return len(self._stages) - 1

    def update(self, task: int, *, advance: int = 0, last: str | None = None, **_: Any) -> None:
        stage = self._stages[task]
        now = self.clock()
        if last is not None:
            stage.last = last
        if advance:
            stage.done += advance
            if stage.first_at is None:
                stage.first_at, stage.first_done = now, stage.done
            bucket = 100 * stage.done // max(stage.total, 1) // self.step_pct
            if bucket > stage.printed_bucket or stage.done >= stage.total:
                stage.printed_bucket = bucket
                self._line(stage, now)
        elif last is not None and now - stage.detail_at >= self.detail_every_s:
            stage.detail_at = now
            self.console.print(f"{stage.name}: {stage.done}/{stage.total} · {stage.last}")

    def _line(self, stage: _Stage, now: float) -> None:
        elapsed = now - stage.started
        if stage.done >= stage.total:
            when = f"done in {_duration(elapsed)}"
        else:
            when = f"{_duration(elapsed)} elapsed, ETA {_duration(_remaining(stage, now))}"
        pct = 100 * stage.done // max(stage.total, 1)
        detail = f" · {stage.last}" if stage.last else ""
        self.console.print(f"{stage.name}: {stage.done}/{stage.total} ({pct}%), {when}{detail}")
