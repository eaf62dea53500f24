"""Properties that must hold for every input, checked on many random ones (hypothesis): padding never reaches a
pooled vector, pooling weights sum to one, AUROC flips with its labels, pair-grouped folds never split a group."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import roc_auc_score
from tolerances import assert_pooled_close

from poolbench.extractor.activations import ActivationBatch
from poolbench.pooler.pool import pool_tokens
from poolbench.pooler.registry import resolve_strategies
from poolbench.prober.auroc import auroc
from poolbench.prober.fast_folds import stratified_group_splits

# The strategies that read hidden states alone (attention, gradients and parses need a real model or text).
PLAIN = [s for s in resolve_strategies(None) if not s.needs]
# Derandomized: the same examples on every run and machine, so CI never fails on a draw a laptop did not make.
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None)

token = st.lists(st.integers(-9, 9).map(float), min_size=3, max_size=3)  # d = 3; small integers: exact sums
passage = st.lists(token, min_size=1, max_size=7)


def padded(passages: list[list[list[float]]], pad: int, left: list[bool], garbage: float) -> ActivationBatch:
    """One layer; passage b padded on the left or right to the longest + `pad`, the padding rows `garbage`."""
    length = max(len(p) for p in passages) + pad
    hidden = np.full((1, len(passages), length, 3), garbage, dtype=np.float32)
    mask = np.zeros((len(passages), length), dtype=bool)
    for b, tokens in enumerate(passages):
        start = length - len(tokens) if left[b] else 0
        hidden[0, b, start:start + len(tokens)] = tokens
        mask[b, start:start + len(tokens)] = True
    n = len(passages)
    return ActivationBatch(passage_ids=[f"p{b}" for b in range(n)], texts=["text"] * n, layers=(0,),
                           hidden=hidden, attention_mask=mask, input_ids=np.zeros((n, length), dtype=np.int64),
                           offsets=np.zeros((n, length, 2), dtype=np.int32),
                           special_mask=np.zeros((n, length), dtype=bool))


@pytest.mark.numerics
@SETTINGS
@given(passages=st.lists(passage, min_size=1, max_size=3), pad=st.integers(0, 4), data=st.data(),
       garbage=st.sampled_from([0.0, 99.0, -1e4]))
def test_padding_never_changes_a_pooled_vector(passages, pad, data, garbage):
    """A passage pools the same alone and unpadded as inside a batch, padded on either side with any values."""
    left = data.draw(st.lists(st.booleans(), min_size=len(passages), max_size=len(passages)))
    together = pool_tokens(padded(passages, pad, left, garbage), PLAIN)
    for b, tokens in enumerate(passages):
        single = padded([tokens], 0, [False], garbage)
        alone = pool_tokens(single, PLAIN)
        assert_pooled_close(together.vectors[:, :, b], alone.vectors[:, :, 0], single)
        assert (together.fallback[:, b] == alone.fallback[:, 0]).all()


@pytest.mark.numerics
@SETTINGS
@given(vector=token, n_tokens=st.integers(1, 7), pad=st.integers(0, 3), left=st.booleans())
def test_pooling_weights_sum_to_one(vector, n_tokens, pad, left):
    """Every real token holds the same vector v: a strategy whose weights sum to one over the real tokens (and a
    max or min) returns v itself, whatever it weighs by."""
    batch = padded([[vector] * n_tokens], pad, [left], 99.0)
    pooled = pool_tokens(batch, PLAIN)
    for s, spec in enumerate(PLAIN):
        assert_pooled_close(pooled.vectors[0, s, 0], vector, batch, err_msg=spec.id)


@SETTINGS
@given(scores=st.lists(st.integers(-5, 5), min_size=2, max_size=40), data=st.data())
def test_auroc_flips_with_its_labels_and_equals_sklearn(scores, data):
    labels = np.array(data.draw(st.lists(st.integers(0, 1), min_size=len(scores), max_size=len(scores))))
    if labels.min() == labels.max():
        labels[0] = 1 - labels[0]  # both classes, always
    scores = np.array(scores, dtype=float)
    value = auroc(scores, labels)
    assert abs(value - roc_auc_score(labels, scores)) < 1e-12
    assert abs(auroc(scores, 1 - labels) - (1 - value)) < 1e-12
    assert abs(auroc(-scores, labels) - (1 - value)) < 1e-12


@SETTINGS
@given(n_pairs=st.integers(6, 30), n_single=st.integers(0, 8), k=st.integers(2, 5), seed=st.integers(0, 10**6),
       data=st.data())
def test_grouped_folds_never_split_a_group(n_pairs, n_single, k, seed, data):
    """Matched pairs (one positive, one negative), some merged into larger groups at random, plus singletons:
    every group lands whole in one validation fold, and the folds partition the passages."""
    merge = data.draw(st.lists(st.integers(0, n_pairs - 1), min_size=n_pairs, max_size=n_pairs))
    pair_group = [f"g{min(i, merge[i])}" for i in range(n_pairs)]  # pair i joins group of min(i, merge[i])
    groups = np.array([*pair_group, *pair_group, *(f"s{i}" for i in range(n_single))])
    y = np.r_[np.ones(n_pairs, dtype=int), np.zeros(n_pairs, dtype=int),
              np.array(data.draw(st.lists(st.integers(0, 1), min_size=n_single, max_size=n_single)), dtype=int)]
    if len(set(groups)) < k:
        return  # fewer groups than folds: refused by check_folds, tested elsewhere
    splits = stratified_group_splits(y, groups, k, seed)
    assert len(splits) == k
    seen = np.concatenate([val for _, val in splits])
    assert sorted(seen.tolist()) == list(range(y.size))  # each passage validated exactly once
    for fit, val in splits:
        assert set(fit.tolist()).isdisjoint(val.tolist()) and fit.size + val.size == y.size
        assert set(groups[fit]).isdisjoint(groups[val])  # no group on both sides
