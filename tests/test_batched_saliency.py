"""S2's one backward per chunk: the gradient of the sum of every row's log-likelihood gives each row exactly its
own gradient (rows never interact), so the batched extras equal those of one forward and backward per row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import random_llama
from transformers import LlamaForCausalLM

from poolbench.extractor.extract import extract_batches
from poolbench.extractor.padded_batches import PaddedBatch


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
    whole = next(extract_batches(llama, llama.model.layers, [batch], layers, needs={"gradient"}))
    for row in range(rows):
        alone = next(extract_batches(llama, llama.model.layers, [batch.select(slice(row, row + 1))], layers,
                                     needs={"gradient"}))
        for name in ("gradient_norm", "gradient_x_input"):
            np.testing.assert_allclose(whole.extras[name][:, row], alone.extras[name][:, 0], rtol=1e-5, atol=1e-7)
            assert alone.extras[name][:, 0][:, mask[row]].max() > 0  # real tokens do get a gradient
