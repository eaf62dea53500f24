"""The attention inflow kernel (extractor/inflow_kernel.py) on CPU tensors under Triton's interpreter, against the
float32 maps it replaces (attention_reference), through the capture's own `_record` and through real models.

Not collected by the main pass: tests/test_inflow_kernel.py runs this file in a process of its own with
TRITON_INTERPRET=1 (Triton makes its library functions interpreted when it is imported, so the switch cannot be
thrown inside a process that imported it already) and POOLBENCH_INFLOW_KERNEL=on (the kernel on any device).

Bound: test_attention_inflow.py's, derived there for the chunked path, holds for the kernel as it is: the same
exact products summed in float32 in another order, the softmax's max and sum in float32 (no running rescale), its
division, and the mean's sum over <= Tq queries, a tile at a time.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from attention_reference import fp32_reference_record
from test_attention_inflow import assert_records_match, real_model_records, route_for, score_scale, synthetic

from poolbench.extractor import attention_capture, attention_inflow, inflow_kernel

assert os.environ.get("TRITON_INTERPRET") == "1", "run by tests/test_inflow_kernel.py (TRITON_INTERPRET=1)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_kernel_passes_the_check_the_capture_runs_first(dtype) -> None:
    """attention_inflow.kernel_agrees: the kernel against the chunked path on its seeded case, within the bound,
    uncapped and softcapped."""
    assert attention_inflow.kernel_agrees(torch.device("cpu"), dtype) and not inflow_kernel._FAILED
    assert attention_inflow.kernel_agrees(torch.device("cpu"), dtype, 2.0) and not inflow_kernel._FAILED
    # at Llama-3.1-8B's head size, and with an additive mask (transformers' float form) as the capture asks
    assert attention_inflow.kernel_agrees(torch.device("cpu"), dtype, head_dim=128, masks=(dtype,))
    assert attention_inflow.kernel_agrees(torch.device("cpu"), dtype, 2.0, head_dim=128, masks=(dtype,))
    assert not inflow_kernel._FAILED


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """The calls that reached the kernel for a record (the capture's fallback to the chunked path would pass
    silently else). The capture's agreement check runs at each record's head size and mask form the first time it
    meets them (in this process: the check's cache is the module's); its own calls are not counted."""
    checking: list[int] = []
    agrees = attention_inflow.kernel_agrees

    def checked(*args, **kwargs):
        checking.append(1)
        try:
            return agrees(*args, **kwargs)
        finally:
            checking.pop()

    calls = []
    mean_inflow = inflow_kernel.mean_inflow

    def counted(*args, **kwargs):
        if not checking:
            calls.append(args[0].shape)
        return mean_inflow(*args, **kwargs)

    monkeypatch.setattr(attention_inflow, "kernel_agrees", checked)
    monkeypatch.setattr(inflow_kernel, "mean_inflow", counted)
    return calls


def window_mask(length: int, width: int) -> torch.Tensor:
    index = torch.arange(length)
    return (index[None, :] <= index[:, None]) & (index[None, :] > index[:, None] - width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("given", ["none", "bool-4d", "lowest-4d", "window-bool", "window-float", "bidirectional"])
def test_kernel_record_equals_the_reference_for_every_mask_form(kernel_calls, given: str, dtype) -> None:
    """sdpa's is_causal (no mask) and padded bool mask, eager's additive mask at the dtype's lowest value, sliding
    windows as bools and as -inf, an encoder both ways; 70 tokens (two tiles, a partial one), grouped heads, a head
    of 20 (padded to 32 in the tile). A window over padding leaves queries that see nothing: they add nothing."""
    query, key, real = synthetic(2, 6, 2, 70, 20, dtype, seed=7)
    causal = (torch.ones(70, 70, dtype=torch.bool).tril()[None] & real[:, None, :])[:, None]
    masks = {"none": None, "bool-4d": causal, "bidirectional": None,
             "lowest-4d": torch.zeros(causal.shape, dtype=dtype).masked_fill(~causal, torch.finfo(dtype).min),
             "window-bool": window_mask(70, 9)[None, None],
             "window-float": torch.zeros(70, 70, dtype=dtype).masked_fill(~window_mask(70, 9), float("-inf"))[None]}
    module = SimpleNamespace(is_causal=given != "bidirectional")
    kwargs = {"scaling": 0.3, "softcap": 3.0} if given == "window-float" else {}  # Gemma 2's cap
    new, old = route_for(real), route_for(real)
    attention_capture._record(new, module, query, key, masks[given], None, kwargs)
    fp32_reference_record(old, module, query, key, masks[given], None, kwargs)
    assert len(kernel_calls) == 1
    assert_records_match(new.out[0], old.out[0], score_scale(query, key, kwargs), 70, 20, given)
    assert float(new.out[0]["inflow"][0, :, :23].abs().max()) == 0  # row 0's left padding receives nothing


def test_kernel_walks_causal_tiles_of_a_longer_passage(kernel_calls) -> None:
    """150 tokens: three query tiles and three key tiles, so a key tile's walk starts past the first query tile
    (the causal lower bound) and a query tile's stops before the last key tile; fp16 as a third input type."""
    query, key, real = synthetic(1, 4, 4, 150, 16, torch.float16, seed=9)
    new, old = route_for(real), route_for(real)
    module = SimpleNamespace(is_causal=True)
    attention_capture._record(new, module, query, key, None, None, {})
    fp32_reference_record(old, module, query, key, None, None, {})
    assert len(kernel_calls) == 1
    assert_records_match(new.out[0], old.out[0], score_scale(query, key, {}), 150, 16, "150 tokens")


def test_a_passage_of_padding_alone_receives_and_gives_nothing(kernel_calls) -> None:
    query, key, real = synthetic(2, 4, 2, 9, 8, torch.float32)
    real[1] = False
    route = route_for(real)
    attention_capture._record(route, SimpleNamespace(is_causal=True), query, key, None, None, {})
    assert len(kernel_calls) == 1 and not route.out[0]["inflow"][1].isnan().any()
    assert float(route.out[0]["inflow"][1].abs().max()) == 0


@pytest.mark.parametrize(("name", "dtype"), [("llama", torch.float32), ("llama", torch.bfloat16),
                                           ("gemma2", torch.float32)], ids=["llama-fp32", "llama-bf16", "gemma2-fp32"])
def test_a_real_model_through_the_kernel(monkeypatch, kernel_calls, name: str, dtype) -> None:
    """A random Llama's and a Gemma 2 in miniature's sdpa and eager attention (their own masks: bool, additive;
    Gemma's logits softcapped at 2 so the cap bites, a sliding window every other layer, its scaling from
    query_pre_attn_scalar), left and right padding: every layer's record the float32 maps' within the bound (with
    the softcap's term), computed by the kernel."""
    seen, n_layers = real_model_records(monkeypatch, name, dtype)
    assert len(kernel_calls) == len(seen) == 2 * n_layers
    for new, old, scale, n_q, head_dim, _ in seen:
        assert_records_match(new, old, scale, n_q, head_dim, f"{name} {dtype}")
