"""What a capture counts for a bench and the run's log: real against padded tokens, and where the time went."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from poolbench.extractor.padded_batches import PaddedBatch


@dataclass
class ExtractionStats:
    """Counters a bench reads: real tokens vs padded tokens, and where the time went."""

    batches: int = 0
    passages: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    forward_seconds: float = 0.0
    # each chunk's share of forward_seconds, in order: a run's first chunks hold one-time costs (CUDA's start,
    # kernels built on first use) that a sum hides (bench/measured/h200_session36: the first concept 9.4x its raw
    # forward on a machine's first run, 4.3x on its next)
    forward_seconds_each: list[float] = field(default_factory=list)
    convert_seconds: float = 0.0
    pool_seconds: float = 0.0  # inside the capture's sinks (launching device pooling), a pooler's to fill
    transfer_seconds: float = 0.0  # waiting for pooled vectors (or token states) to reach the host
    prepare_seconds: float = 0.0  # making chunks' sinks ready on the host (text extras, weights), either thread
    prepared_ahead: int = 0  # chunks whose preparation ran on the background thread, beside an earlier forward
    finished_late: int = 0  # chunks finished after the next chunk's forward was enqueued (overlap)
    skipped: list[tuple[str, int]] = field(default_factory=list)  # (passage id, tokens) too big for the device
    skipped_indices: list[int] = field(default_factory=list)  # the same passages' indices in the batches' plan

    def count_forward(self, batch: PaddedBatch, seconds: float) -> None:
        """One forward over `batch` that took `seconds`: its passages, real and padded tokens, and its time (the
        capture's and the baselines' one way of counting, so their ratios compare like with like)."""
        self.batches += 1
        self.passages += len(batch.indices)
        self.tokens += int(batch.attention_mask.sum())
        self.padded_tokens += batch.attention_mask.size
        self.forward_seconds += seconds
        self.forward_seconds_each.append(seconds)
