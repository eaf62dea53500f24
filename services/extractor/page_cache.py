"""Read a model's weight files into the page cache while the driver starts Ray and the extractor imports.

The extractor's first act is to read its model's weights. When the page cache no longer holds them (a later hour,
another job's files, this machine's proactive reclaim), that read is the run's only I/O wait: make run's extractor
sat 6 s at 76-98% iowait on the embedded model's 540 MB folder while both cores were otherwise idle
(bench/measured/cpu_session26/make_run3.json). The driver knows the folder seconds before the extractor is up
(Ray's start, the worker's imports), so a thread of its own reads the files then, and the extractor's read finds
them cached. Only where they fit comfortably in the memory that is free: reading a model the cache cannot hold would
only evict other pages. On another node the read is harmless and does not help.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

from poolbench.extractor.batching import free_memory_bytes

CHUNK_BYTES = 8 * 2**20
MEMORY_SHARE = 0.5  # read ahead only what fits in this share of the host's free memory (its cgroup's, if less)


def _read_through(paths: Sequence[Path]) -> None:
    buffer = bytearray(CHUNK_BYTES)
    for path in paths:
        try:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass
        except OSError:  # a file that vanished or cannot be read: the extractor's own load will say so
            continue


def read_ahead(paths: Sequence[Path]) -> threading.Thread | None:
    """Start a daemon thread reading `paths` once through, into the page cache; None (nothing started) when there
    is nothing to read or the files would take more than MEMORY_SHARE of the host's free memory (the page cache
    counts against a cgroup's limit too)."""
    sizes = []
    for path in paths:
        try:
            sizes.append(os.stat(path).st_size)
        except OSError:
            continue
    if not sizes or sum(sizes) > MEMORY_SHARE * free_memory_bytes("cpu"):
        return None
    thread = threading.Thread(target=_read_through, args=(list(paths),), name="poolbench-read-ahead", daemon=True)
    thread.start()
    return thread
