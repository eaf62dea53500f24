"""What one layer of device pooling costs the device: the aten ops DevicePooler.__call__ dispatches (counted with
torch's dispatch mode on CPU) are a small constant that does not grow with the number of strategies, and none of
them moves data between host and device or reads a device value on the host (on CUDA: torch's sync debug mode)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from test_device_pool import BF16_PARTS, LAYER_NAMES, assert_same, sinky_batch
from torch.utils._python_dispatch import TorchDispatchMode

from poolbench.extractor.activations import ActivationBatch
from poolbench.extractor.padded_batches import PaddedBatch
from poolbench.pooler.device_pool import DevicePooler, HostBuffers, bfloat16_parts
from poolbench.pooler.registry import list_strategies
from poolbench.pooler.spec import StrategySpec
from poolbench.pooler.windows import window_spec

# Kernels per layer at most (measured 46 and 74, with 20 and 26 views, at torch 2.13; the strategy loop this
# replaced dispatched 66 and 152 kernels and 39 and 58 views, and 10 more strategies added 6 kernels, 23 views):
# the plain strategies' norms, sink rule, weight rows, normalisation, product and max/min, and with S1-S3 the
# attention means, their sink rule in float64, the gradients and S3's per-head weights on top.
PLAIN_OPS, ALL_OPS = 48, 80
# ops that bring host data to the device or a device value to the host: never inside the layer loop
HOST_OPS = {"lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "_pin_memory", "item"}


class CountOps(TorchDispatchMode):
    """Every aten op dispatched inside the block, and each cross-device copy (source device, target device)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views = 0  # views and aliases: new tensor metadata, no kernel
        self.names: set[str] = set()  # every op, views included
        self.moves: list[tuple[str, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.names.add(name)
        if func.is_view:
            self.views += 1
        else:
            self.ops[name] += 1
        if name in ("_to_copy", "copy_", "copy") and isinstance(out, torch.Tensor):
            source = args[1] if name == "copy_" else args[0]
            if isinstance(source, torch.Tensor) and source.device != out.device:
                self.moves.append((name, str(source.device), str(out.device)))
        return out

    @property
    def total(self) -> int:
        """The ops that run a kernel (views left out)."""
        return sum(self.ops.values())


def plain_strategies() -> list[StrategySpec]:
    return [s for s in list_strategies() if not s.needs]


def card_strategies() -> list[StrategySpec]:
    """The 19 of the card, L4-L6 and L1-L3 (parses) left out: their weights are static rows like W1's."""
    return [s for s in list_strategies() if "parse" not in s.needs]


def more_of_the_same() -> list[StrategySpec]:
    """Ten more strategies of kinds a set already has (static windows, a keep-mode max): rows, not new rules."""
    windows = [window_spec(code, k=k) for code in ("W1", "W2", "W3") for k in (2, 3, 5)]
    keep_max = next(s for s in list_strategies(include_reference=True) if s.id == "A2_ref_max")
    return [*windows, keep_max]


def layer_calls(batch: ActivationBatch, specs: list[StrategySpec], device: str = "cpu",
                dtype: torch.dtype = torch.float32, *, staged: bool | None = None,
                buffers: HostBuffers | None = None) -> tuple[DevicePooler, list]:
    """A DevicePooler for the batch (`staged`, `buffers`: DevicePooler's) and, per layer, the (layer, states,
    extras) the capture would hand it."""
    chunk = PaddedBatch(list(range(len(batch.passage_ids))), batch.passage_ids, batch.texts, batch.input_ids,
                        batch.attention_mask, batch.offsets, batch.special_mask)
    host = {k: v for k, v in batch.extras.items() if k not in LAYER_NAMES and not k.startswith("attention_")}
    pooler = DevicePooler(specs, chunk, batch.layers, host, torch.device(device), buffers=buffers, staged=staged)
    calls = [(layer, torch.from_numpy(batch.hidden[i]).to(device=device, dtype=dtype),
              {k: torch.from_numpy(batch.extras[k][i]).to(device) for k in LAYER_NAMES})
             for i, layer in enumerate(batch.layers)]
    return pooler, calls


def ops_per_layer(specs: list[StrategySpec], dtype: torch.dtype = torch.float32) -> list[CountOps]:
    """The ops of each layer's call (the first one also allocates the chunk's buffers)."""
    pooler, calls = layer_calls(sinky_batch(0), specs, dtype=dtype)
    counts = []
    for layer, hidden, extras in calls:
        with CountOps() as count:
            pooler(layer, hidden, extras)
        counts.append(count)
    pooler.finish()
    return counts


@pytest.mark.parametrize(("strategies", "bound"), [(plain_strategies, PLAIN_OPS), (card_strategies, ALL_OPS)])
def test_ops_per_layer_are_few_and_do_not_grow_with_the_strategies(strategies, bound) -> None:
    specs = strategies()
    more = specs + more_of_the_same()
    assert len(more) == len(specs) + 10
    few, many = ops_per_layer(specs)[1:], ops_per_layer(more)[1:]
    assert [(c.total, c.views) for c in few] == [(c.total, c.views) for c in many]
    assert few[0].ops == many[0].ops  # the very same ops, not just as many
    assert few[0].total == few[1].total <= bound


def test_bfloat16_states_take_one_cast_more_than_float32() -> None:
    """bfloat16 states on CPU are cast once (the product needs float32 there, and CPU's bfloat16 kernels are slower
    than the cast); CUDA reads them as they are (tested under the gpu mark)."""
    specs = card_strategies()
    bf16, fp32 = ops_per_layer(specs, torch.bfloat16)[1], ops_per_layer(specs)[1]
    assert bf16.total == fp32.total + 1 and bf16.ops - fp32.ops == Counter({"_to_copy": 1})


def test_the_layer_loop_moves_nothing_between_host_and_device() -> None:
    """No tensor from a Python list (lift_fresh), no .item()/.tolist() (_local_scalar_dense), no pinning and no
    copy across devices inside any layer's call."""
    for count in ops_per_layer(card_strategies()):
        assert not count.names & HOST_OPS, count.names & HOST_OPS
        assert count.moves == []


def test_one_host_buffer_serves_a_run_of_chunks() -> None:
    """A run's chunks reuse one host buffer once each chunk's rows are taken out; a bigger chunk grows it once."""
    buffers = HostBuffers(pin=False)
    specs = card_strategies()
    for batch in (sinky_batch(0), sinky_batch(1), sinky_batch(2, batch=9), sinky_batch(3)):
        chunk = PaddedBatch(list(range(len(batch.passage_ids))), batch.passage_ids, batch.texts, batch.input_ids,
                            batch.attention_mask, batch.offsets, batch.special_mask)
        pooler = DevicePooler(specs, chunk, batch.layers, {}, torch.device("cpu"), buffers=buffers)
        for i, layer in enumerate(batch.layers):
            pooler(layer, torch.from_numpy(batch.hidden[i]),
                   {k: torch.from_numpy(batch.extras[k][i]) for k in LAYER_NAMES})
        pooler.finish()
        assert_same(pooler, batch, specs)
        pooler.release()
    assert buffers.allocated == 2  # the first chunk's, then one for the chunk of nine passages



def test_a_chunk_larger_than_every_free_buffer_lets_the_largest_go_whatever_their_order() -> None:
    """Buffers come back from the table thread in any order; a chunk too big for all of them drops the largest
    (memory stays bounded) and gets a new one. Dropping it with list.remove compared tensors elementwise and raised
    whenever the largest was not first (the intermittent failure of the overlap test in test_device_pool)."""
    buffers = HostBuffers(pin=False)
    small, large = buffers.take(10), buffers.take(20)
    buffers.give(small)
    buffers.give(large)  # the largest is not first
    grown = buffers.take(30)
    assert grown.numel() == 30 and buffers.allocated == 3
    assert buffers.take(5) is small  # the small one stayed, the large one was let go
    assert buffers.allocated == 3

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_loop_never_waits_for_the_gpu(dtype) -> None:
    """Every layer's pooling launched with CUDA's sync debug mode set to raise: no stream synchronisation, no copy
    to the host at all; then the pooled vectors equal the numpy twin (bfloat16: on the states cast to float32)."""
    batch = sinky_batch(5)
    specs = [s for s in list_strategies() if "parse" not in s.needs] + more_of_the_same()
    pooler, calls = layer_calls(batch, specs, "cuda", dtype)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with CountOps() as count:
            for layer, hidden, extras in calls:
                pooler(layer, hidden, extras)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not count.names & HOST_OPS
    assert count.moves == []  # the layers write the device's staging; one copy at launch (test_device_staging)
    pooler.finish()
    cast = torch.from_numpy(batch.hidden).to(dtype).float().numpy()
    assert_same(pooler, ActivationBatch(**{**batch.__dict__, "hidden": cast}), specs,
                BF16_PARTS if dtype == torch.bfloat16 else 0)


def test_three_bfloat16_parts_hold_float32_weights_exactly() -> None:
    """The CPU twin of CUDA's bfloat16 product (weighted_sums): the parts sum back to every float32 weight bit for
    bit, normalised weights of any size and tiny ones included: the three GEMMs of exact products hold the float32
    product's terms, summed in another order (the bound in tests/test_device_pool.py)."""
    rng = np.random.default_rng(0)
    raw = rng.random((4, 7, 300)).astype(np.float32) ** 8 + np.float32(1e-30) * rng.random((4, 7, 300)).astype(
        np.float32)
    weights = torch.from_numpy(raw / raw.sum(axis=-1, keepdims=True))
    parts = bfloat16_parts(weights).float().unflatten(1, (3, 7))
    assert parts.dtype == torch.float32 and not torch.equal(parts[:, 0], weights)  # one part alone rounds
    assert torch.equal(parts[:, 0] + parts[:, 1] + parts[:, 2], weights)
