"""Seeded, deterministic CPU torch for a block of work (model builds, SAE training, fine-tuning demos)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def deterministic_cpu(seed: int, threads: int) -> Iterator[None]:
    """Same seed and thread count give the same bits; the caller's RNG, threads and determinism flag come back after."""
    prev_threads = torch.get_num_threads()
    prev_det = torch.are_deterministic_algorithms_enabled()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(prev_det)
            torch.set_num_threads(prev_threads)
