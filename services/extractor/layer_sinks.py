"""Where a capture hands each layer's token states: the sink contract device pooling implements, and the
reference sink that copies every layer to the host as an ActivationBatch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

from poolbench.extractor.activations import ActivationBatch
from poolbench.extractor.padded_batches import PaddedBatch


def _torch_dtype(dtype_out: np.dtype | type) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype_out)).dtype


LayerExtras = Mapping[str, torch.Tensor]


class LayerSink(Protocol):
    """What a capture hands each requested layer to: its token states [B, T, d] on the model's device and that
    layer's extras on the same device ("attention_head_inflow" / "attention_head_inflow_last" [B, H, T],
    "attention_head_output_last" [B, H, Dh], "gradient_norm" / "gradient_x_input" [B, T]); `finish` runs once
    after the forward (and backward), where device work may be waited for."""

    def __call__(self, layer: int, hidden: torch.Tensor, extras: LayerExtras) -> None: ...

    def finish(self) -> None: ...


@runtime_checkable
class LaunchedSink(Protocol):
    """A sink that may be finished one chunk late: `launched` runs once the chunk's forward (and backward) is
    enqueued and starts every copy `finish` will read (page-locked, non-blocking) behind one event, so `finish`
    waits for this chunk's work alone, not for a later chunk's forward enqueued after it; it returns False where
    `finish` cannot wait that way (a tee around a sink that copies with blocking copies). The capture then
    enqueues the next chunk before it finishes this one, and the device never waits for the host between
    chunks (capture.capture_chunks with `overlap`)."""

    def launched(self) -> bool: ...


class KeptLayers:
    """A chunk's layers (token states and extras, on their device) kept until its sink exists, then handed to it in
    order: the very tensors the sink would have been handed as each layer ran, so the same values
    (capture.capture_chunks runs a job's first forward before its sink is made)."""

    def __init__(self) -> None:
        self.layers: list[tuple[int, torch.Tensor, LayerExtras]] = []

    def __call__(self, layer: int, hidden: torch.Tensor, extras: LayerExtras) -> None:
        self.layers.append((layer, hidden, dict(extras)))

    def finish(self) -> None:
        raise AssertionError("kept layers are handed to their chunk's sink, never finished")

    def hand_to(self, sink: LayerSink) -> None:
        for layer, hidden, extras in self.layers:
            sink(layer, hidden, extras)
        self.layers = []


SinkT = TypeVar("SinkT", bound=LayerSink)


class HostCapture:
    """Today's hand-off, kept as the reference: every layer's token states into one buffer, then to the host as
    an ActivationBatch (numpy) for numpy pooling, activation dumps and other readers of token states."""

    def __init__(self, batch: PaddedBatch, layers: Sequence[int], dtype_out: np.dtype | type = np.float32) -> None:
        self.batch = batch
        self.layers = tuple(layers)
        self._dtype = _torch_dtype(dtype_out)
        self._position = {layer: i for i, layer in enumerate(self.layers)}
        self._buffer: torch.Tensor | None = None
        self._extras: dict[int, LayerExtras] = {}
        self.activations: ActivationBatch | None = None

    def __call__(self, layer: int, hidden: torch.Tensor, extras: LayerExtras) -> None:
        if self._buffer is None:
            self._buffer = torch.empty((len(self.layers), *hidden.shape), dtype=self._dtype, device=hidden.device)
        self._buffer[self._position[layer]].copy_(hidden)
        self._extras[layer] = extras

    def finish(self) -> None:
        assert self._buffer is not None
        b = self.batch
        self.activations = ActivationBatch(
            passage_ids=b.passage_ids, texts=b.texts, layers=self.layers, hidden=self._buffer.cpu().numpy(),
            attention_mask=b.attention_mask, input_ids=b.input_ids, offsets=b.offsets, special_mask=b.special_mask,
            extras=stack_layer_extras([self._extras[layer] for layer in self.layers]))
        self._buffer = None


def stack_layer_extras(per_layer: Sequence[LayerExtras]) -> dict[str, np.ndarray]:
    """Per-layer device extras stacked to the [L, ...] numpy extras strategies read, plus S1's head means."""
    if not per_layer or not per_layer[0]:
        return {}
    extras = {name: torch.stack([layer[name] for layer in per_layer]).cpu().numpy() for name in per_layer[0]}
    if "attention_head_inflow" in extras:
        extras["attention_inflow"] = extras["attention_head_inflow"].mean(axis=2)
        extras["attention_inflow_last"] = extras["attention_head_inflow_last"].mean(axis=2)
    return extras
