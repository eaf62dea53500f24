"""How far the pooling may run ahead of D1 when each concept's vectors leave the store once its D1 is stored
(`run --drop-pooled`): a pooling job starts when its files fit the room the store's disk has now, beside the files
of the jobs started and not yet written; a job that does not fit waits, and the jobs after it (concept order is
kept), until a concept's vectors leave.

Without a bound the pooling runs ahead as fast as the forward allows (on a CPU every concept is pooled before the
first probe), so dropping would save nothing at the peak. The room is read from the disk at each decision, so what
else the run keeps there (per-passage scores, D1 records, parses) is counted as it lands. A job is admitted whatever
its size when no admitted concept's vectors are in the store (store_room checks before the first forward that the
largest concept fits the disk at all), so the pooling never stalls for good.

A job's bytes are counted from its vectors (pooler.stored_size: the payload, a lower bound); its files take more by
their ids, strings and framing: ~1% at d 4,096, more than half again at a toy's d 64 (this CPU: a shape:smoke
concept's files, 1.58x its count). And once pooled, a concept's probes write what stays: its D1 records and
per-passage scores (~0.25 GB a concept at 19 strategies x 6 layers, against ~10 GB of vectors at d 4,096; at a
toy's width more than the vectors). So each admitted concept holds room for its vector files until they are written
and for its D1 files until its vectors leave, both at the largest ratio to its count measured on a concept so far
(`measured`, `dropped`); until the first concept has been pooled and probed, one concept runs at a time (its
passes over its layers, where the host's memory cuts them, one after another). A test on a 45 MiB disk
(bench/README.md) filled it with vectors and then had no room for their scores before the D1 share was counted.

Where the run would otherwise stand still (no job and no probe running, a job waiting), the driver starts the
waiting job whatever the room (`force`): a later pass of a concept whose first passes fill the room, say, after the
disk shrank under other writes. It may then meet a full disk: one line and a resumable store, never a run that
waits for a room nothing will free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

J = TypeVar("J")


@dataclass
class RoomGate(Generic[J]):
    """Pooling jobs admitted within `room()`, the bytes the pooling's files may take now (None: no bound)."""

    room: Callable[[], int] | None
    counted: dict[str, int] = field(default_factory=dict)  # concept -> its admitted jobs' count, until dropped
    unwritten: dict[str, int] = field(default_factory=dict)  # concept -> the count of its jobs not yet measured
    scale: float | None = None  # the vector files' bytes a counted byte takes, at most, once measured
    d1_scale: float | None = None  # the D1 files' bytes (records, per-passage scores) a counted byte brings
    held: deque[tuple[dict[str, int], J]] = field(default_factory=deque)

    def admit(self, need: Mapping[str, int], job: J) -> list[J]:
        """A pooling job writing `need` counted bytes for each of its concepts: [job] if it may start now, else []
        (it waits behind any job already waiting)."""
        self.held.append((dict(need), job))
        return self._release()

    def measured(self, concept: str, stored: int) -> list[J]:
        """A concept's jobs so far are written, its files `stored` bytes on disk (now inside room()'s reading):
        the waiting jobs that fit at the ratio now known."""
        self.unwritten.pop(concept, None)
        if self.counted.get(concept, 0) > 0:
            self.scale = max(self.scale or 0.0, stored / self.counted[concept])
        return self._release()

    def dropped(self, concept: str, d1_stored: int = 0) -> list[J]:
        """A concept's D1 files are written (`d1_stored` bytes) and its vectors left the store: the waiting jobs
        that fit now, in order."""
        counted = self.counted.pop(concept, 0)
        self.unwritten.pop(concept, None)
        if counted > 0:
            self.d1_scale = max(self.d1_scale or 0.0, d1_stored / counted)
        return self._release()

    def force(self) -> list[J]:
        """The first waiting job, started whatever the room: nothing else is left to free it."""
        if not self.held:
            return []
        need, job = self.held.popleft()
        self._count(need)
        return [job]

    @property
    def waiting(self) -> int:
        return len(self.held)

    def _release(self) -> list[J]:
        out = []
        while self.held and self._fits(self.held[0][0]):
            need, job = self.held.popleft()
            self._count(need)
            out.append(job)
        return out

    def _count(self, need: Mapping[str, int]) -> None:
        for concept, size in need.items():  # a concept pooled in passes adds each pass's layers
            self.counted[concept] = self.counted.get(concept, 0) + size
            self.unwritten[concept] = self.unwritten.get(concept, 0) + size

    def _fits(self, need: Mapping[str, int]) -> bool:
        if self.room is None or not self.counted:
            return True
        if self.scale is None or self.d1_scale is None:  # the first concept's later passes only
            return set(need) <= set(self.counted)
        size = sum(need.values())
        vectors = (sum(self.unwritten.values()) + size) * self.scale
        return vectors + (sum(self.counted.values()) + size) * self.d1_scale <= self.room()
