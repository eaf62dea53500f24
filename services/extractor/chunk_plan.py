"""The row chunks a capture runs, in order: each padded batch cut at the token budget when it comes up, halved after
an out-of-memory error (every later batch then cut at the smaller size), and S2's sub-chunks inside a chunk."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from poolbench.extractor.batching import TokenCosts, gradient_rows_per_forward, row_chunks, rows_per_forward
from poolbench.extractor.padded_batches import PaddedBatch

logger = logging.getLogger(__name__)


class ChunkPlan:
    """The row chunks of the batches in order, each batch cut at the budget when it comes up; after an
    out-of-memory halving every later batch is cut at the smaller size, one already looked at (to prepare its
    first chunk ahead) included. S2's sub-chunks (from the free memory at the start) halve with them."""

    def __init__(self, batches: Iterator[PaddedBatch], costs: TokenCosts, budget: int, free_bytes: int = 0) -> None:
        self._batches = enumerate(batches)
        self._costs, self._budget, self._free = costs, budget, free_bytes
        self._logged: set[int] = set()
        self._halvings = 0
        self._pending: list[tuple[int, PaddedBatch]] = []
        self._looked: tuple[int, PaddedBatch, int, list[tuple[int, PaddedBatch]]] | None = None  # index, batch,
        # the halvings it was cut at, its chunks

    def _cut(self, index: int, batch: PaddedBatch) -> list[tuple[int, PaddedBatch]]:
        rows = max(1, rows_per_forward(self._costs, self._budget, batch.input_ids.shape[1]) >> self._halvings)
        return [(index, batch.select(chunk)) for chunk in row_chunks(len(batch.indices), rows)]

    def gradient_rows(self, length: int) -> int:
        """Rows of one S2 forward + backward inside a chunk of padded length `length` (0 without S2)."""
        if not self._costs.gradient:
            return 0
        chunk = rows_per_forward(self._costs, self._budget, length)
        rows = gradient_rows_per_forward(self._costs, self._budget, length, self._free)
        if rows < chunk and length not in self._logged:
            self._logged.add(length)
            logger.info("S2 at %d tokens: forward + backward over %d rows at a time inside chunks of %d rows "
                        "(%.1f GiB free); the other strategies pool the whole chunk", length, rows, chunk,
                        self._free / 2**30)
        return max(1, rows >> self._halvings)

    def _look(self) -> bool:
        """Cut the next batch (once) without starting it; False at the end."""
        if self._looked is None:
            for index, batch in self._batches:
                self._looked = (index, batch, self._halvings, self._cut(index, batch))
                break
        return self._looked is not None

    def next(self) -> tuple[int, PaddedBatch] | None:
        """The next chunk to capture, or None when every batch is done."""
        while not self._pending:
            if not self._look():
                return None
            assert self._looked is not None
            index, batch, halvings, chunks = self._looked
            self._looked = None
            self._pending = chunks if halvings == self._halvings else self._cut(index, batch)
        return self._pending.pop(0)

    def peek(self) -> PaddedBatch | None:
        """The chunk after the one `next` gave, as it stands now (a halving may still replace it)."""
        if self._pending:
            return self._pending[0][1]
        if not self._look():
            return None
        assert self._looked is not None
        chunks = self._looked[3]
        return chunks[0][1] if chunks else None

    def halve(self, index: int, chunk: PaddedBatch) -> None:
        """Retry `chunk` as its two halves, first; this batch's other chunks keep their size, later ones shrink."""
        self._halvings += 1
        n = len(chunk.indices)
        self._pending[:0] = [(index, chunk.select(slice(0, n // 2))), (index, chunk.select(slice(n // 2, n)))]
