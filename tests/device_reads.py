"""What reads a device value on the host, counted on any device: the aten ops whose result the host needs before it
can go on. On CUDA each waits for the stream's queue (every kernel enqueued before it); on a CPU they cost nothing,
so a test counts them with torch's dispatch mode to hold a GPU path's reads where this CPU can check them."""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops whose result the host needs before it can go on (on CUDA each waits for the stream's queue); an index by
# a boolean mask is a nonzero inside
READS = {"nonzero", "_local_scalar_dense", "item", "masked_select", "unique", "_unique2", "unique_consecutive",
         "repeat_interleave", "bincount", "histc", "is_nonzero", "equal", "allclose"}


class DeviceReads(TorchDispatchMode):
    """Each op of READS dispatched inside the block, with the file of the innermost frame outside torch."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func.overloadpacket.__name__
        if name in ("index", "index_put", "index_put_") and len(args) > 1 and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1] if t is not None):
            name += "[bool]"  # an index by a boolean mask: a nonzero inside the kernel (CPU's dispatch shows none)
        if name in READS or name.endswith("[bool]"):
            frames = [f.filename for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            self.reads.append((name, frames[-1] if frames else "?"))
        return func(*args, **(kwargs or {}))
