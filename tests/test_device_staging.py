"""A device pooler's output staged on the device and sent to the host in one copy a chunk (device_staging): the
layers write nothing to the host buffer, the one copy at `launched` brings every value (pooled vectors, S3's heads,
the fallback and weight flags) bit for bit as the unstaged pooler writes them, with no op more a layer. On CUDA
(gpu-marked): no copy at all inside the layer loop, one on a stream other than the compute stream, no sync."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_device_pool import assert_same, every_strategy, sinky_batch
from test_device_pool_ops import HOST_OPS, CountOps, layer_calls

from poolbench.errors import StrategyError
from poolbench.pooler.device_pool import STAGED_ENV, DevicePooler, HostBuffers, staged_by_default
from poolbench.pooler.device_staging import DeviceStaging, flat_views, layout_numel
from poolbench.pooler.registry import list_strategies


def pooled(batch, specs, *, staged, buffers=None) -> DevicePooler:
    pooler, calls = layer_calls(batch, specs, staged=staged, buffers=buffers)
    for call in calls:
        pooler(*call)
    pooler.finish()
    return pooler


def test_flat_views_lay_the_shapes_end_to_end() -> None:
    shapes = {"a": (2, 3), "b": (4,), "c": (1, 2, 2)}
    buffer = torch.arange(20, dtype=torch.float32)
    views = flat_views(buffer, shapes)
    assert layout_numel(shapes) == 14
    assert views["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and views["b"].tolist() == [6, 7, 8, 9]
    assert views["c"].flatten().tolist() == [10, 11, 12, 13]
    assert all(view.data_ptr() >= buffer.data_ptr() for view in views.values())  # views, not copies
    views["b"][0] = -1.0
    assert buffer[6] == -1.0


@pytest.mark.parametrize("seed", range(2))
def test_staged_pooling_writes_the_host_only_at_launch_and_the_same_values(seed: int) -> None:
    """A used host buffer larger than the chunk (the run's buffers are reused) filled with NaN: after every layer
    it is untouched (nothing per layer went to the host), after `launched` its first stretch holds what the
    unstaged pooler wrote to its own buffer, bit for bit: vectors, S3's heads and outputs, fallbacks."""
    batch = sinky_batch(seed)
    specs = every_strategy(parse=False)
    plain = pooled(batch, specs, staged=False)
    buffers = HostBuffers(pin=False)
    big = torch.full((10**6,), float("nan"))
    buffers.give(big)
    pooler, calls = layer_calls(batch, specs, staged=True, buffers=buffers)
    for call in calls:
        pooler(*call)
    assert torch.isnan(big).all()
    pooler.finish()
    assert pooler.pooled is not None and plain.pooled is not None
    assert pooler.pooled.vectors.ctypes.data == big.data_ptr()  # the tables read the host buffer itself
    np.testing.assert_array_equal(pooler.pooled.vectors, plain.pooled.vectors)
    np.testing.assert_array_equal(pooler.pooled.fallback, plain.pooled.fallback)
    assert plain.pooled.fallback.any()  # a passage whose S2 weights are all zero: the flags came through
    assert pooler.heads is not None and plain.heads is not None
    for staged_part, plain_part in zip(pooler.heads, plain.heads, strict=True):
        np.testing.assert_array_equal(staged_part, plain_part)
    assert_same(pooler, batch, specs)


def test_staging_adds_no_op_to_a_layer() -> None:
    """The very same ops a layer, staged or not (a CPU writes into the host buffer directly): the staging only
    moves where they write. The one copy comes at launch."""
    batch = sinky_batch(1)
    specs = [s for s in list_strategies() if "parse" not in s.needs]
    counts = {}
    for staged in (False, True):
        pooler, calls = layer_calls(batch, specs, staged=staged)
        pooler(*calls[0])  # the first call also allocates the chunk's buffers
        with CountOps() as count:
            for call in calls[1:]:
                pooler(*call)
        with CountOps() as launch:
            pooler.launched()
        counts[staged] = (count.ops, launch.ops)
        pooler.finish()
    assert counts[True][0] == counts[False][0]
    assert counts[True][1] - counts[False][1] == {"copy_": 1}


def test_a_staged_pooler_still_refuses_bad_weights_from_the_flags() -> None:
    batch = sinky_batch(2)
    batch.extras["gradient_norm"][1, 2, 0] = -1.0
    spec = next(s for s in list_strategies() if s.id == "S2_gradient")
    with pytest.raises(StrategyError, match=r"'S2_gradient': weights must be finite and non-negative"):
        pooled(batch, [spec], staged=True)


def test_staging_is_the_default_on_a_device_but_not_on_the_cpu(monkeypatch) -> None:
    monkeypatch.delenv(STAGED_ENV, raising=False)
    assert staged_by_default(torch.device("cuda", 0)) and not staged_by_default(torch.device("cpu"))
    monkeypatch.setenv(STAGED_ENV, "0")
    assert not staged_by_default(torch.device("cuda", 0))


def test_a_staging_buffer_is_sent_once() -> None:
    staging = DeviceStaging({"out": (2, 2)}, torch.device("cpu"))
    staging.views["out"].fill_(3.0)
    host = torch.zeros(6)
    assert staging.send(host) is None  # on a CPU the copy is done
    assert host.tolist() == [3.0] * 4 + [0.0, 0.0] and staging.views == {}
    with pytest.raises(AssertionError, match="sent once"):
        staging.send(host)


class CopyStreams(CountOps):
    """CountOps that also notes the current CUDA stream at each cross-device copy."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.moves)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.moves) > before:
            self.streams.append(torch.cuda.current_stream().stream_id)
        return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_layers_copy_nothing_and_one_copy_goes_on_the_copy_stream(dtype, monkeypatch) -> None:
    """Sync debug mode set to raise through the layers and the launch: no copy to the host inside the layer loop,
    exactly one at `launched`, on a stream that is not the compute stream; the values equal the numpy twin and
    the unstaged pooler's (the per-layer copies, $POOLBENCH_STAGED_COPIES=0) bit for bit."""
    batch = sinky_batch(5)
    specs = [s for s in list_strategies() if "parse" not in s.needs]
    monkeypatch.delenv(STAGED_ENV, raising=False)
    pooler, calls = layer_calls(batch, specs, "cuda", dtype)
    compute = torch.cuda.current_stream().stream_id
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with CopyStreams() as layers:
            for call in calls:
                pooler(*call)
        with CopyStreams() as launch:
            pooler.launched()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert layers.moves == [] and not layers.names & HOST_OPS
    assert [(source, target) for _, source, target in launch.moves] == [("cuda:0", "cpu")]
    assert launch.streams != [compute]
    pooler.finish()
    monkeypatch.setenv(STAGED_ENV, "0")
    unstaged, calls = layer_calls(batch, specs, "cuda", dtype)
    for call in calls:
        unstaged(*call)
    unstaged.finish()
    assert pooler.pooled is not None and unstaged.pooled is not None
    np.testing.assert_array_equal(pooler.pooled.vectors, unstaged.pooled.vectors)
    np.testing.assert_array_equal(pooler.pooled.fallback, unstaged.pooled.fallback)
