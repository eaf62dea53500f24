"""S3_iti_probe: head selection sees only the training labels of each D1 fold, and the whole path runs
end to end (pool_concept -> PooledTable with per-head rows -> probe_pooled_table)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from poolbench.corpus.passage import Passage
from poolbench.extractor.loading import LoadedModel
from poolbench.pooler.concept_pooling import pool_concept
from poolbench.pooler.parses import load_nlp
from poolbench.pooler.pooled_table import PooledTableView
from poolbench.pooler.registry import get_strategy, list_strategies
from poolbench.prober.concept_probe import probe_pooled_table
from poolbench.prober.d1 import cv_splits
from poolbench.prober.supervised import HeadSelectionCell, evaluate_d1_supervised, n_heads_kept

N_TRAIN, N_TEST, N_FOLDS = 200, 80, 5


def labelled(n: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """Matched pairs: rows 2i (pos) and 2i+1 (neg) share group offset+i."""
    y = np.tile([1, 0], n // 2)
    groups = np.repeat([f"g{offset + i}" for i in range(n // 2)], 2)
    return y, groups


def signal(y: np.ndarray, rows: np.ndarray, rng: np.random.Generator, dim: int) -> np.ndarray:
    """[n, dim] noise, with rows `rows` replaced by a strong copy of their label."""
    out = rng.normal(size=(len(y), dim))
    out[rows] = 4.0 * (2 * y[rows, None] - 1) + 0.1 * rng.normal(size=(len(rows), dim))
    return out


def test_heads_kept_are_a_fraction_of_the_model_heads() -> None:
    assert [n_heads_kept(h) for h in (1, 2, 4, 8, 32)] == [1, 1, 1, 2, 8]
    assert n_heads_kept(32, 0.5) == 16


def test_head_selection_never_sees_test_labels() -> None:
    """Head 0 predicts the *test* labels perfectly and nothing on train; head 1 predicts 30% of the train
    labels. Selection on the train split must keep head 1; selection that also looked at the test rows
    would keep head 0 and score test AUROC 1."""
    rng = np.random.default_rng(0)
    n_test = N_TRAIN
    y_tr, g_tr = labelled(N_TRAIN, 0)
    y_te, g_te = labelled(n_test, 10_000)
    y, groups = np.concatenate([y_tr, y_te]), np.concatenate([g_tr, g_te])
    train, test = np.arange(N_TRAIN), np.arange(N_TRAIN, N_TRAIN + n_test)
    some_train = rng.choice(train, size=int(0.3 * N_TRAIN), replace=False)
    features = np.stack([signal(y, test, rng, 2), signal(y, some_train, rng, 2),
                         rng.normal(size=(len(y), 2)), rng.normal(size=(len(y), 2))], axis=1)
    pooled = np.stack([signal(y, test, rng, 3), rng.normal(size=(len(y), 3)),
                       rng.normal(size=(len(y), 3)), rng.normal(size=(len(y), 3))])
    cell = HeadSelectionCell(pooled, features, y, groups, n_keep=1)
    result = evaluate_d1_supervised(cell, y, groups, train, test, n_folds=N_FOLDS, n_bootstrap=50)
    assert cell.chosen == [[1]] * (N_FOLDS + 1)
    assert result["logistic"].test_auroc < 0.75


def test_head_selection_inside_a_fold_never_sees_that_folds_validation_labels() -> None:
    """Head k predicts exactly the labels of D1 fold k's validation rows (noise elsewhere), in its features
    and its pooled vector. Fold k must never pick head k: on fold k's training rows head k is pure noise."""
    rng = np.random.default_rng(1)
    y, groups = labelled(N_TRAIN, 0)
    test = np.arange(N_TRAIN, N_TRAIN + N_TEST)
    y_te, g_te = labelled(N_TEST, 10_000)
    y_all, g_all = np.concatenate([y, y_te]), np.concatenate([groups, g_te])
    splits = cv_splits(y, groups, N_FOLDS, seed=0)
    features = np.stack([signal(y_all, val, rng, 2) for _, val in splits], axis=1)  # [N, 5 heads, 2]
    pooled = np.stack([signal(y_all, val, rng, 3) for _, val in splits])
    cell = HeadSelectionCell(pooled, features, y_all, g_all, n_keep=1)
    result = evaluate_d1_supervised(cell, y_all, g_all, np.arange(N_TRAIN), test, n_folds=N_FOLDS,
                                    n_bootstrap=50)
    for k, heads in enumerate(cell.chosen[:N_FOLDS]):
        assert heads != [k], f"fold {k} picked the head that encodes its own validation labels"
    assert result["logistic"].cv_auroc < 0.75  # a leak would give one fold AUROC 1


# ----------------------------------------------------------------------------- end to end on a tiny Llama

WORDS = ["the", "river", "cat", "sat", "if", "rain", "falls", "we", "stay", "home", "not", "never", "sun"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LoadedModel:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 5, trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True),
        processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=32,
                                         vocab_size=len(tokenizer))).eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, model_id="tiny",
                       path=Path(tmp_path_factory.mktemp("m")), kind="causal", n_layers=2, hidden_size=16,
                       dtype=torch.float32, device=torch.device("cpu"), weights_hash="tiny",
                       decoder_layers=model.model.layers)


def passages(n_pairs: int, split: str) -> list[Passage]:
    rng = np.random.default_rng(len(split))
    out = []
    for i in range(n_pairs):
        base = " ".join(rng.choice(WORDS, size=6))
        for label, text in ((1, f"if {base} not"), (0, f"{base} sun")):
            out.append(Passage(f"{split}{i}-{label}", text, label, "d", 8, f"{split}{i}", split, "negation"))
    return out


def test_s3_pools_head_rows_and_the_prober_evaluates_one_cell(tiny) -> None:
    data = passages(12, "train") + passages(6, "test")
    table = pool_concept(tiny, data, [0, 1], [get_strategy("A1"), get_strategy("S3_iti_probe")], batch_size=8)
    strategies = set(table.column("strategy").to_pylist())
    assert strategies == {"A1_mean", "S3_iti_probe", *(f"S3_iti_probe@head{h}" for h in range(4)),
                          "S3_iti_probe@feat0"}  # 4 heads x head_dim 4 = 16 = one hidden-size chunk
    assert table.schema.metadata[b"S3_iti_probe:heads"] == b"4"
    records = probe_pooled_table(table, "negation", n_folds=3, n_bootstrap=20)
    cells = {(r.layer, r.strategy) for r in records}
    assert cells == {(layer, s) for layer in (0, 1) for s in ("A1_mean", "S3_iti_probe")}
    s3 = [r for r in records if r.strategy == "S3_iti_probe"]
    assert all(len(r.heads_selected) == 1 and r.fallback_count == 0 for r in s3)


def test_every_strategy_through_pool_concept_reports_fallbacks_per_cell(tiny) -> None:
    """All card strategies and variants in one pool_concept call (spaCy parses, attention, gradients, train
    statistics); L3 falls back exactly on the passages where spaCy finds no entity, and D1 counts them."""
    data = passages(12, "train") + passages(6, "test")
    specs = list_strategies(include_reference=True)
    table = pool_concept(tiny, data, [1], specs, batch_size=16)
    view = PooledTableView(table)
    for spec in specs:
        cell = view.matrix(1, spec.id)
        assert np.isfinite(cell.X).all() and len(cell.y) == len(data)
    nlp = load_nlp()
    no_entity = {p.id: not nlp(p.text).ents for p in data}
    l3_cell = view.matrix(1, "L3_entity")
    assert l3_cell.fallback.tolist() == [no_entity[pid] for pid in l3_cell.passage_ids]
    assert sum(no_entity.values()) > len(data) // 2  # word salad: mostly no entity
    assert not view.matrix(1, "S2_gradient").fallback.any() and not view.matrix(1, "L6_sentence").fallback.any()
    records = probe_pooled_table(table, "negation", n_folds=3, n_bootstrap=10)
    l3 = [r for r in records if r.strategy == "L3_entity"]
    n_fallback = sum(no_entity.values())
    assert l3 and all(r.fallback_count == n_fallback and r.fallback_rate == n_fallback / len(data) for r in l3)
    sif = view.matrix(1, "S2_sif_pc1")
    train = sif.split == "train"
    u = np.linalg.svd(view.matrix(1, "S2_sif").X[train].astype(np.float64), full_matrices=False)[2][0]
    np.testing.assert_allclose(sif.X @ u, 0, atol=1e-3)  # the train split's first component is gone
