"""S2's forward + backward sized by the free memory: the graph model against autograd's own saved tensors, the rows
an 8B model gets on an 80 GB card, the plain strategies' chunk never cut by S2, and S2's sub-chunks joined into one
chunk equal to a single pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import random_llama
from tolerances import assert_float32_close
from transformers import LlamaConfig, LlamaForCausalLM

from poolbench.extractor import capture
from poolbench.extractor.batching import (
    default_max_batch_tokens,
    gradient_rows_per_forward,
    rows_per_forward,
    token_costs,
)
from poolbench.extractor.capture import model_token_costs
from poolbench.extractor.extract import extract_batches
from poolbench.extractor.padded_batches import PaddedBatch

LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "n_heads": 32, "vocab_size": 128256, "n_layers": 32,
            "kv_size": 8 * 128, "itemsize": 2, "out_itemsize": 4}
DEFAULT_8B_LAYERS = [0, 6, 12, 19, 25, 31]  # driver.pipeline.default_layers(32)
# An 80 GB card less Llama-3.1-8B's 8.03 B bf16 weights (16.06 GB) and ~1 GB of CUDA context: about 63 GB free.
FREE_80GB = int(80e9 - 16.06e9 - 1e9)


def test_an_8b_model_gets_16_rows_of_512_with_s2_on_80_gb() -> None:
    plain = token_costs(**LLAMA_8B, layers=DEFAULT_8B_LAYERS)
    s2 = token_costs(**LLAMA_8B, layers=DEFAULT_8B_LAYERS, needs={"gradient"})
    budget = default_max_batch_tokens(FREE_80GB, plain.plain)
    assert budget == 8192  # a quarter of 63 GB over 376,832 B/token is 41,700 tokens: today's cap binds
    # graph from layer 0: 32 blocks x (2*(3*14336 + 3*4096 + 2*1024) + 4*2*4096) = 32 x 147,456 B per token
    assert s2.gradient == 4_718_592
    assert s2.head_chunk == 523 * 128256 * 16  # 1 GiB of logits work: 523 tokens a chunk
    # 0.8 x 62.94 GB - 1.07 GB head - 16 x 512 x 376,832 (the chunk's plain bytes) = 46.2 GB over
    # 512 x (376,832 + 4,718,592) = 2.61 GB a row: 17 rows fit; the chunk has 16
    assert gradient_rows_per_forward(s2, 17 * 512, 512, FREE_80GB) == 17  # were the chunk not the limit
    assert gradient_rows_per_forward(s2, budget, 512, FREE_80GB) == 16
    assert rows_per_forward(s2, budget, 512) == rows_per_forward(plain, budget, 512) == 16


def test_s2_never_cuts_the_plain_strategies_chunk() -> None:
    """The old model let S2 take max(budget x plain, 512 MiB): 1-2 rows for every strategy of the run."""
    for layers in (DEFAULT_8B_LAYERS, list(range(32))):
        plain = token_costs(**LLAMA_8B, layers=layers)
        s2 = token_costs(**LLAMA_8B, layers=layers, needs={"gradient"})
        for length in (128, 400, 512, 2048):
            assert rows_per_forward(s2, 8192, length) == rows_per_forward(plain, 8192, length)
    # with little free memory S2 runs fewer rows at a time inside the same chunk, never fewer than one
    s2 = token_costs(**LLAMA_8B, layers=DEFAULT_8B_LAYERS, needs={"gradient"})
    assert rows_per_forward(s2, 8192, 512) == 16
    assert gradient_rows_per_forward(s2, 8192, 512, 24 * 10**9) == 5  # (19.2 - 1.07 - 3.09) GB // 2.61 GB
    assert gradient_rows_per_forward(s2, 8192, 512, 10**9) == 1


def _saved_bytes_per_token(model: LlamaForCausalLM, leaf: int, rows: int, length: int) -> float:
    """Bytes autograd saves per token from block `leaf`'s output (made a grad leaf) to the final hidden state,
    weights aside (they exist anyway)."""
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage().data_ptr()
        if key not in weights:
            seen[key] = max(seen.get(key, 0), tensor.untyped_storage().nbytes())
        return tensor

    def hook(_module, _args, output):
        return (output[0].detach().requires_grad_(True), *output[1:]) if isinstance(output, tuple) else \
            output.detach().requires_grad_(True)

    handle = model.model.layers[leaf].register_forward_hook(hook)
    ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    return sum(seen.values()) / (rows * length)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_model_covers_what_autograd_saves(attention: str, dtype: torch.dtype) -> None:
    """token_costs' S2 graph against the bytes autograd really saves, on Llama-shaped models with frozen
    weights: never less (an OOM), and at most 1.5x (rows thrown away)."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=224, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=100, attn_implementation=attention)
    model = LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)
    length = 48
    costs = model_token_costs(model, [0, 3], {"gradient"})
    modelled = costs.gradient + costs.gradient_per_key * length
    measured = _saved_bytes_per_token(model, 0, 2, length)
    assert measured <= modelled <= 1.5 * measured, (measured, modelled)


def test_s2_sub_chunks_join_into_the_plain_chunk(monkeypatch) -> None:
    """With free memory for one row of S2 at a time, a 4-row chunk still reaches the sink whole (the plain
    strategies pool it once), its S2 extras equal to one forward + backward over all 4 rows."""
    llama = random_llama()
    rows, length = 4, 9
    ids = torch.randint(3, 50, (rows, length), generator=torch.Generator().manual_seed(2)).numpy()
    mask = np.ones((rows, length), dtype=bool)
    for row, n in enumerate((9, 6, 4, 2)):
        mask[row, n:] = False
    batch = PaddedBatch(list(range(rows)), [f"p{r}" for r in range(rows)], ["x"] * rows, ids, mask,
                        np.zeros((rows, length, 2), np.int32), np.zeros((rows, length), bool))
    needs = {"gradient", "attention"}
    whole = next(extract_batches(llama, llama.model.layers, [batch], (1, 2), needs=needs,
                                 max_batch_tokens=rows * length))
    costs = model_token_costs(llama, (1, 2), needs)
    per_row = length * (costs.plain + costs.attention_per_token + costs.gradient
                        + (costs.attention_per_key + costs.gradient_per_key) * length)
    one_row = int((costs.head_chunk + costs.attention_reserve + rows * length * costs.plain + 1.5 * per_row) / 0.8)
    monkeypatch.setattr(capture, "free_memory_bytes", lambda _device: one_row)
    sizes: list[int] = []
    forward = capture.gradient_forward

    def counted(model, modules, inputs, mask, layers, write, **kwargs):
        sizes.append(int(mask.shape[0]))
        forward(model, modules, inputs, mask, layers, write, **kwargs)

    monkeypatch.setattr(capture, "gradient_forward", counted)
    out = list(extract_batches(llama, llama.model.layers, [batch], (1, 2), needs=needs,
                               max_batch_tokens=rows * length))
    assert sizes == [1, 1, 1, 1] and len(out) == 1  # four S2 passes, one chunk to the sink
    [split] = out
    assert set(split.extras) == set(whole.extras)
    terms = 3 * (32 + 64 + length)  # as test_batched_saliency: rows in a batch of 4 vs alone
    np.testing.assert_array_equal(split.hidden.shape, whole.hidden.shape)
    assert_float32_close(split.hidden, whole.hidden, terms=terms)
    for name, got in split.extras.items():
        scale = float(np.abs(whole.extras[name]).max())
        assert_float32_close(got, whole.extras[name], terms=terms, scale=scale, err_msg=name)
