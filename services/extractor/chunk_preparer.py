"""A chunk's host-side preparation (its text extras and pooling weights), run for the next chunk on a background
thread while the current chunk's forward runs, so the device does not wait for the host between chunks."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic

from poolbench.extractor.extraction_stats import ExtractionStats
from poolbench.extractor.layer_sinks import SinkT
from poolbench.extractor.padded_batches import PaddedBatch

Prepare = Callable[[PaddedBatch], Callable[[], SinkT]]  # a chunk's host work, returning what makes its sink


class ChunkPreparer(Generic[SinkT]):
    """Runs chunks' preparations, the next one on a background thread while a forward runs when `overlap`
    (torch releases the GIL in its ops); a preparation made for one chunk object is only ever used for that
    object, never for the halves of a chunk cut after it."""

    def __init__(self, prepare: Prepare[SinkT], overlap: bool, stats: ExtractionStats | None) -> None:
        self._prepare = prepare
        self._stats = stats
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="poolbench-prepare") if overlap else None
        self._slot: tuple[PaddedBatch, Future[tuple[Callable[[], SinkT], float]]] | None = None

    def __enter__(self) -> ChunkPreparer[SinkT]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _timed(self, chunk: PaddedBatch) -> tuple[Callable[[], SinkT], float]:
        start = time.perf_counter()
        make = self._prepare(chunk)
        return make, time.perf_counter() - start

    def take(self, chunk: PaddedBatch) -> Callable[[], SinkT]:
        """`chunk`'s preparation: the one made ahead for this very chunk, else made now."""
        slot, self._slot = self._slot, None
        if slot is not None and slot[0] is chunk:
            make, seconds = slot[1].result()
            if self._stats is not None:
                self._stats.prepared_ahead += 1
        else:
            if slot is not None:
                slot[1].cancel()
            make, seconds = self._timed(chunk)
        if self._stats is not None:
            self._stats.prepare_seconds += seconds
        return make

    def ahead(self, chunk: PaddedBatch) -> None:
        """Start preparing `chunk` in the background (with overlap), to be taken after the current forward."""
        if self._pool is not None and (self._slot is None or self._slot[0] is not chunk):
            if self._slot is not None:
                self._slot[1].cancel()
            self._slot = (chunk, self._pool.submit(self._timed, chunk))
