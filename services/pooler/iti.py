"""S3_iti_probe, supervised: pooling weights from the attention heads that best predict the concept.

Per layer and head h: the feature of a passage is the head's output at the last real token (its
attention-weighted sum of values, before o_proj, as in inference-time intervention), one logistic probe per
head is cross-validated on it, and the top heads (a fraction of the model's heads, default 25%, at least one)
give the token weights: the mean of their per-head-normalised attention inflow. Because each head's weights
sum to 1, the pooled vector is the mean of the chosen heads' per-head pooled vectors, so pooling stores every
head's pooled vector ("S3_iti_probe@head<h>") and features ("S3_iti_probe@feat<c>", the [H*Dh] head outputs
cut into hidden-size chunks, zero-padded), and the prober picks heads inside each D1 fold on that fold's
training part only (poolbench.prober.supervised). The plain "S3_iti_probe" row holds the all-heads mean.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from poolbench.extractor.activations import ActivationBatch
from poolbench.pooler.saliency import attention_inflow_weights
from poolbench.pooler.spec import StrategySpec

HEAD_FRACTION = 0.25
HEAD_TAG, FEATURE_TAG = "@head", "@feat"


def head_row_names(strategy_id: str, n_heads: int, n_chunks: int) -> list[str]:
    return ([f"{strategy_id}{HEAD_TAG}{h}" for h in range(n_heads)]
            + [f"{strategy_id}{FEATURE_TAG}{c}" for c in range(n_chunks)])


def head_rows(batch: ActivationBatch, spec: StrategySpec) -> tuple[list[str], np.ndarray]:
    """Per-head pooled vectors and per-head features of one batch as extra PooledTable rows [L, H+C, B, d]."""
    inflow = np.asarray(batch.extras["attention_head_inflow"], dtype=np.float32)  # [L, B, H, T]
    features = np.asarray(batch.extras["attention_head_output_last"], dtype=np.float32)  # [L, B, H, Dh]
    n_layers, n_batch, n_heads, _ = inflow.shape
    dim = batch.hidden.shape[-1]
    weights = np.where(batch.attention_mask[None, :, None, :], inflow, 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    weights = np.where(total > 0, weights / np.where(total > 0, total, 1), 0.0).astype(np.float32)
    pooled = torch.matmul(torch.from_numpy(weights), torch.from_numpy(batch.hidden))  # [L, B, H, d]
    flat = features.reshape(n_layers, n_batch, -1)
    n_chunks = math.ceil(flat.shape[-1] / dim)
    padded = np.zeros((n_layers, n_batch, n_chunks * dim), dtype=np.float32)
    padded[..., : flat.shape[-1]] = flat
    chunks = padded.reshape(n_layers, n_batch, n_chunks, dim)
    vectors = np.concatenate([pooled.numpy(), chunks], axis=2).transpose(0, 2, 1, 3)  # [L, H+C, B, d]
    return head_row_names(spec.id, n_heads, n_chunks), np.ascontiguousarray(vectors)


def head_shape(batch: ActivationBatch) -> tuple[int, int]:
    """(heads, head dim) of the batch's captured head outputs."""
    _, _, n_heads, head_dim = batch.extras["attention_head_output_last"].shape
    return int(n_heads), int(head_dim)


SPECS = (
    StrategySpec(
        id="S3_iti_probe", code="S3", family="saliency_weighted", kind="weights",
        weights_fn=attention_inflow_weights, needs=frozenset({"attention", "labels"}), supervision="labels",
        params=(("head_fraction", HEAD_FRACTION),),
        description="Attention inflow of the heads whose last-token outputs best predict the concept "
                    "(top 25% of heads by CV AUROC, chosen inside each D1 fold on its training part).",
    ),
)
