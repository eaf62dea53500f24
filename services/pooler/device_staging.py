"""A chunk's pooled vectors staged on the device, then sent to the host in one copy on a stream of their own.

Per layer the pooler writes into a device buffer laid out as the chunk's page-locked host buffer (pooled vectors,
S3's head vectors and head outputs, the flags). Once the chunk's last layer is enqueued, a copy stream waits for
the compute stream there and copies the whole buffer to the host, while the compute stream goes on with the next
chunk's forward (or, inside S2's backward, with the layers below). Before, each layer's vectors went to the host by
a copy on the compute stream itself: the copy engine did it, but stream order held every later kernel behind it
(at 16 x 512 tokens of the 8B shape, 4.2 MB a layer for the hidden-state strategies and 13.6 MB with S3's heads:
~0.08 and ~0.27 ms of stalled compute a layer at PCIe 5's ~50 GB/s, 256 layer calls a stage). Values do not move:
the same kernels write the same numbers, only into device memory first.

What the staging holds is a chunk's pooled output (at that shape 0.44 GB with S3's heads, at most two chunks at once
with late finishing); the budget does not count it, it lives in the allocator's slack that the budget leaves.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import torch

_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_LOCK = threading.Lock()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The process's one copy stream for this CUDA device (streams are cheap to keep, not to make per chunk)."""
    with _LOCK:
        stream = _COPY_STREAMS.get(device)
        if stream is None:
            stream = _COPY_STREAMS[device] = torch.cuda.Stream(device=device)
        return stream


def flat_views(buffer: torch.Tensor, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Views of consecutive stretches of a flat buffer, one per named shape, in order (the host buffer's layout)."""
    views, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        views[name] = buffer[offset:offset + size].view(shape)
        offset += size
    return views


def layout_numel(shapes: Mapping[str, tuple[int, ...]]) -> int:
    return sum(int(np.prod(shape)) for shape in shapes.values())


class DeviceStaging:
    """A chunk's output on its device (`views`, the host buffer's layout), sent to the host in one copy by `send`."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], device: torch.device) -> None:
        self.numel = layout_numel(shapes)
        # A normal tensor, as the host buffer (HostBuffers.take): the first layer's hook makes it inside the forward's
        # inference mode, and `launched` writes the flags into it after the forward, outside.
        with torch.inference_mode(False):
            self._buffer: torch.Tensor | None = torch.empty(self.numel, dtype=torch.float32, device=device)
        self.views = flat_views(self._buffer, shapes)

    def send(self, host: torch.Tensor) -> torch.cuda.Event | None:
        """Copy the staged output into host[:numel] behind everything enqueued on the device's current stream so far,
        and let the device buffer go. On CUDA the copy runs on the copy stream (page-locked host memory, non-blocking)
        and the returned event marks its end: the caller waits for that, never for the device; the allocator is told
        the buffer is in use on the copy stream, so it is not handed out again before the copy has read it. On a CPU
        the copy is done when this returns (None)."""
        buffer, self._buffer, self.views = self._buffer, None, {}
        assert buffer is not None, "a staging buffer is sent once"
        target = host[:self.numel]
        if not buffer.is_cuda:
            target.copy_(buffer)
            return None
        stream = copy_stream(buffer.device)
        stream.wait_stream(torch.cuda.current_stream(buffer.device))
        with torch.cuda.stream(stream):
            target.copy_(buffer, non_blocking=True)
        buffer.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
        return done
