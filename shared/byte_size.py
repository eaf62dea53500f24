"""Bytes as a person reads them, for the lines a run prints about memory and disk (the store's room, the hosts')."""

from __future__ import annotations

GB = 1e9


def size(n_bytes: int) -> str:
    """GB from 0.1 GB, MB from 0.1 MB, else bytes."""
    if n_bytes >= GB / 10:
        return f"{n_bytes / GB:.1f} GB"
    return f"{n_bytes / 1e6:.1f} MB" if n_bytes >= 1e5 else f"{n_bytes} bytes"
