"""The learned-aggregation family (LA1-LA4): token weights of each aggregator on hand-set parameters, the outer fits
equal to D1's folds, the per-fold cell, and D1 at chance on a label-flipped corpus (far above it on the true one).

Tolerances: token weights are softmaxes / means of a few float32 terms of magnitude 1 (tests/tolerances.py,
float32_atol with the terms counted); AUROC bounds are statistical (a CI covers 0.5 on random labels)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tolerances import assert_float32_close

from poolbench.corpus.passage import Passage
from poolbench.pooler.learned import LearnedFoldView, fit_learned_layer, grid_of
from poolbench.pooler.learned_aggregators import AggregatorBank, AggregatorParams, best_window_weights, window_means
from poolbench.pooler.learned_fits import outer_fit_rows
from poolbench.pooler.pooled_table import PooledMatrix
from poolbench.pooler.registry import get_strategy, list_strategies
from poolbench.prober.auroc import ProbeError
from poolbench.prober.d1 import cv_splits
from poolbench.prober.learned_cell import LearnedFoldCell, learned_fold_cell
from poolbench.prober.supervised import evaluate_d1_supervised

LEARNED = ("LA1_attention_probe", "LA2_softmax_probe", "LA3_multimax", "LA4_rolling_max")


def test_window_means_and_the_best_window_read_right_padded_passages() -> None:
    scores = torch.tensor([[[1.0, 2.0, 3.0, 4.0, 0.0], [5.0, 1.0, 0.0, 0.0, 0.0]]])  # [M=1, N=2, T=5]
    mask = torch.tensor([[True, True, True, True, False], [True, False, False, False, False]])
    means = window_means(scores, mask, torch.tensor([2]))
    assert means[0, 0, 1:4].tolist() == [1.5, 2.5, 3.5]  # windows ending at tokens 1..3 of the 4-token passage
    assert means[0, 0, 0] < -1e8 and means[0, 0, 4] < -1e8  # no full window ends at token 0; 4 is padding
    assert means[0, 1, 0] == 5.0 and (means[0, 1, 1:] < -1e8).all()  # a 1-token passage: its one token
    weights = best_window_weights(scores, mask, torch.tensor([2]))
    assert weights[0].tolist() == [[0.0, 0.0, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]]


def _bank(kind: str, points: list[AggregatorParams], dim: int) -> AggregatorBank:
    bank = AggregatorBank(kind, dim, points)
    with torch.no_grad():
        bank.score.zero_()
    return bank


def test_multimax_pools_each_active_heads_argmax_token_equally() -> None:
    Z = torch.tensor([[[1.0, 0.0], [0.0, 3.0], [2.0, 0.0], [0.0, 0.0]]])  # one passage, 3 real tokens + padding
    mask = torch.tensor([[True, True, True, False]])
    position = torch.zeros(1, 4)
    bank = _bank("multimax", [AggregatorParams(heads=2), AggregatorParams(heads=1)], 2)
    with torch.no_grad():
        bank.score[:, 0] = torch.tensor([1.0, 0.0])  # head 0 reads dimension 0: token 2 is its max
        bank.score[:, 1] = torch.tensor([0.0, 1.0])  # head 1 reads dimension 1: token 1 (off in the 1-head model)
    weights = bank.token_weights(Z, mask, position)
    assert weights[0, 0].tolist() == [0.0, 0.5, 0.5, 0.0]
    assert weights[1, 0].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert bank.logits(Z, mask, position).detach().tolist() == [[5.0], [2.0]]  # 2 + 3 with both heads, 2 with one


def test_attention_probe_weights_follow_its_position_bias_and_skip_padding() -> None:
    Z = torch.zeros(1, 4, 3)
    mask = torch.tensor([[True, True, True, False]])
    position = torch.tensor([[0.0, 0.5, 1.0, 0.0]])
    bank = _bank("attention", [AggregatorParams(heads=1, position_bias=True), AggregatorParams(heads=1)], 3)
    with torch.no_grad():
        bank.position[:, 0] = 2 * math.log(2.0)  # exp(b·pos) = 1, 2, 4
    weights = bank.token_weights(Z, mask, position)
    assert_float32_close(weights[0, 0], [1 / 7, 2 / 7, 4 / 7, 0.0], terms=3)
    assert_float32_close(weights[1, 0], [1 / 3, 1 / 3, 1 / 3, 0.0], terms=3)  # bias off: a zero query is uniform


def test_softmax_probe_logit_is_the_softmax_weighted_mean_of_token_logits() -> None:
    Z = torch.tensor([[[0.0], [math.log(3.0)]]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    bank = _bank("softmax", [AggregatorParams(temperature=1.0)], 1)
    with torch.no_grad():
        bank.score[0, 0, 0] = 1.0
        bank.bias[0] = 0.5
    assert_float32_close(bank.token_weights(Z, mask, torch.zeros(1, 2))[0, 0], [0.25, 0.75], terms=2)
    assert_float32_close(bank.logits(Z, mask, torch.zeros(1, 2)).detach()[0], [0.75 * math.log(3.0) + 0.5], terms=3)


def test_outer_fits_train_on_exactly_d1s_fold_training_parts_then_the_whole_train_split() -> None:
    y = np.tile([1, 0], 20)
    groups = np.repeat([f"p{i}" for i in range(20)], 2)
    train = np.arange(30)
    sets = outer_fit_rows(y, groups, train, 5, 0)
    expected = [train[fit] for fit, _ in cv_splits(y[train], groups[train], 5, 0)]
    assert [sorted(s.tolist()) for s in sets[:5]] == [sorted(e.tolist()) for e in expected]
    assert sets[5].tolist() == train.tolist()


def test_a_learned_cell_hands_out_the_fit_of_the_folds_own_passages_and_refuses_any_other() -> None:
    ids = np.array(["a", "b", "c", "d"])
    vectors = np.arange(2 * 4 * 2, dtype=np.float64).reshape(2, 4, 2)
    cell = LearnedFoldCell("LA3_multimax", 0, ids, vectors, [frozenset({"a", "b"}), frozenset({"a", "b", "c"})])
    assert np.array_equal(cell.design(np.array([1, 0])), vectors[0])
    assert np.array_equal(cell.design(np.array([0, 1, 2])), vectors[1])
    with pytest.raises(ProbeError, match="no learned fit was trained on this fold's 2 passages"):
        cell.design(np.array([0, 2]))


def test_the_family_is_listed_with_citations_but_not_in_a_default_run() -> None:
    default = {spec.id for spec in list_strategies()}
    listed = {spec.id: spec for spec in list_strategies(include_opt_in=True)}
    assert not default & set(LEARNED) and set(LEARNED) <= set(listed)
    assert "2601.11516" in listed["LA3_multimax"].description
    assert "NeurIPS 2025" in listed["LA1_attention_probe"].description
    assert [p.heads for p in grid_of(get_strategy("LA1"))] == [1, 1, 4, 4]
    assert [p.window for p in grid_of(get_strategy("LA4"))] == [3, 8]


def planted_corpus(labels: np.ndarray, seed: int) -> tuple[list[Passage], list[torch.Tensor]]:
    """Pairs of passages of 6-12 noise tokens in d=8; the first of each pair (label 1 in the true corpus) has one
    token at +5 along dimension 0 at a random place. `labels` are the labels written into the passages."""
    rng = np.random.default_rng(seed)
    passages, states = [], []
    for i, label in enumerate(labels):
        pair, split = i // 2, ("train" if i < 40 else "test")
        tokens = rng.normal(size=(int(rng.integers(6, 13)), 8)).astype(np.float32)
        if i % 2 == 0:
            tokens[rng.integers(len(tokens)), 0] += 5.0
        passages.append(Passage(f"p{i}", f"text {i}", int(label), "d", len(tokens), f"g{pair}", split, "planted"))
        states.append(torch.from_numpy(tokens))
    return passages, states


def learned_d1(passages: list[Passage], states: list[torch.Tensor], strategy: str) -> float:
    """The held-out logistic AUROC and its CI of one learned strategy on the corpus, through the per-fold table."""
    pooling = fit_learned_layer(passages, states, 0, [get_strategy(strategy)])
    ids = np.array([p.id for p in passages])
    matrix = PooledMatrix(ids, pooling.final[strategy], np.array([p.label for p in passages]),
                          np.array([p.group for p in passages]), np.array([p.split for p in passages]),
                          np.zeros(len(ids), dtype=bool))
    cell = learned_fold_cell(matrix, {f"{strategy}:learned_fits": "6"}, LearnedFoldView(pooling.table), 0, strategy)
    assert cell is not None
    train, test = np.flatnonzero(matrix.split == "train"), np.flatnonzero(matrix.split == "test")
    result = evaluate_d1_supervised(cell, matrix.y, matrix.groups, train, test, probes=("logistic",))
    return result["logistic"]


@pytest.mark.parametrize("strategy", LEARNED)
def test_d1_is_at_chance_on_a_label_flipped_corpus_and_high_on_the_true_one(strategy: str) -> None:
    true_labels = np.tile([1, 0], 30)
    truth = learned_d1(*planted_corpus(true_labels, 0), strategy)
    assert truth.test_auroc > 0.9  # the should-fail side: the same fit does find a planted token
    coin = np.random.default_rng(1).integers(0, 2, 30)  # labels no longer say which passage has the token
    flipped = np.empty(60, dtype=np.int64)
    flipped[0::2], flipped[1::2] = coin, 1 - coin  # each pair keeps one passage of each label
    chance = learned_d1(*planted_corpus(flipped, 0), strategy)
    assert chance.ci_low < 0.5 < chance.ci_high
    assert abs(chance.cv_auroc - 0.5) < 0.25


@pytest.mark.parametrize("strategy", LEARNED)
def test_no_held_out_passage_shapes_a_fit_whatever_its_length_or_content(strategy: str) -> None:
    """Every fit reads the training rows only (learned_fits trains on them alone, cut to their longest passage):
    giving the held-out test passages other states, 6x as long, leaves every fit's pooled vector of every training
    passage where it was. Should fail if the test rows (or their padding) reached the loss or the standardisation."""
    passages, states = planted_corpus(np.tile([1, 0], 30), 0)
    rng = np.random.default_rng(7)
    other = [s if p.split == "train" else torch.from_numpy(rng.normal(size=(6 * len(s), 8)).astype(np.float32) * 3)
             for p, s in zip(passages, states, strict=True)]
    spec = get_strategy(strategy)
    before, after = (fit_learned_layer(passages, s, 0, [spec]) for s in (states, other))
    train = np.array([p.split == "train" for p in passages])
    a, b = (LearnedFoldView(f.table).cell(0, strategy, np.array([p.id for p in passages])) for f in (before, after))
    # the weights are softmaxes / means over <= 12 tokens of magnitude <= 6 (5 planted + noise): a few roundings
    assert_float32_close(b[:, train], a[:, train], terms=12 * 8, scale=8.0)
    assert not np.allclose(b[:, ~train], a[:, ~train])  # the test rows themselves did change
