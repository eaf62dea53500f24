"""Which device a bench ran on and the most memory it held there: the CUDA device's name or the CPU's model, and
the CUDA allocator's peak or the process's peak RSS. One copy for extraction_cost.py and scale.py (whose extractor
actors read them too: scale_counters.py ships this module to them by value)."""

from __future__ import annotations

import contextlib
import resource
from pathlib import Path

import torch


def device_name(device: torch.device) -> str:
    """The CUDA device's name, or the CPU's model name from /proc/cpuinfo."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "cpu"


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
