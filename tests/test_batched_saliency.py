"""S2's one backward per chunk: the gradient of the sum of every row's log-likelihood gives each row exactly its
own gradient (rows never interact), so the batched extras equal those of one forward and backward per row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import random_llama
from tolerances import assert_float32_close
from transformers import LlamaForCausalLM

from poolbench.extractor.extract import extract_batches
from poolbench.extractor.padded_batches import PaddedBatch

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    return random_llama()


@pytest.mark.parametrize("left", [False, True])
def test_batched_gradients_equal_per_row_gradients(llama, left: bool) -> None:
    rows, length = 4, 9
    ids = torch.randint(3, 50, (rows, length), generator=torch.Generator().manual_seed(2)).numpy()
    mask = np.ones((rows, length), dtype=bool)
    for row, n in enumerate((9, 6, 4, 2)):
        if left:
            mask[row, : length - n] = False
        else:
            mask[row, n:] = False
    batch = PaddedBatch(list(range(rows)), [f"p{r}" for r in range(rows)], ["x"] * rows, ids, mask,
                        np.zeros((rows, length, 2), np.int32), np.zeros((rows, length), bool))
    layers = (1, 2)
    whole = next(extract_batches(llama, llama.model.layers, [batch], layers, needs={"gradient"},
                                 max_batch_tokens=rows * length))  # one forward of 4 rows, whatever the default
    for row in range(rows):
        alone = next(extract_batches(llama, llama.model.layers, [batch.select(slice(row, row + 1))], layers,
                                     needs={"gradient"}))
        # A batch of 4 and a batch of 1 take different kernel blockings, so the gradients agree to round-off, not
        # bit for bit. The backward from the head crosses 3 layers, each summing over the hidden size (32), the MLP
        # width (64) and the 9 positions: ~315 roundings. Their scale is the row's largest gradient norm ‖g‖ (the
        # attention mixes positions' gradients), and for g·x the terms' size ‖g‖·‖x_t‖ (Cauchy–Schwarz) — not
        # g·x itself, which cancels to ~0 at the last layer: the final RMSNorm is scale-invariant, so g ⟂ x.
        # Measured on AVX-512, AVX2 and default kernels: at most 1.4 eps·scale, against 4·√315 ≈ 71 allowed.
        terms = 3 * (32 + 64 + length)
        g_max = float(alone.extras["gradient_norm"][:, 0].max())
        x_norm = np.linalg.norm(alone.hidden[:, 0], axis=-1)
        for name, scale in (("gradient_norm", g_max), ("gradient_x_input", g_max * x_norm)):
            got, want = whole.extras[name][:, row], alone.extras[name][:, 0]
            assert_float32_close(got, want, terms=terms, scale=scale, err_msg=f"{name} row {row}")
            assert want[:, mask[row]].max() > 0  # real tokens do get a gradient
