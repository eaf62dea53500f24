"""Scorers sharing their frozen lower blocks: each probability equal to the scorer's own, bit for bit, and the
shared blocks run once per batch; scorers whose frozen parts differ are scored alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poolbench.extractor.loading import find_decoder_layers
from poolbench.scorer.finetune import ScorerConfig, fine_tune
from poolbench.scorer.scorer_model import ScorerModel
from poolbench.scorer.shared_trunk import score_texts, trunk_groups

WORDS = ["calm", "angry", "bright", "dull", "quick", "slow", "warm", "cold"]
TEXTS = [" ".join(WORDS[(i * k) % 8] for k in range(1, 2 + i % 9)) + f" number {i}" for i in range(23)]


def _scorer(encoder, concept: str, positive: set[str], tmp_path, **info) -> ScorerModel:
    """A classifier B fine-tuned from the tiny encoder (its top block and head), stored and read back as a run
    reads it."""
    config = ScorerConfig(encoder=str(encoder), epochs=2, batch_size=8, max_length=16, seed=len(concept))
    labels = [int(bool(positive & set(t.split()))) for t in TEXTS]
    tuned = fine_tune(str(encoder), TEXTS, labels, config)
    folder = tmp_path / concept
    ScorerModel(tuned.model, tuned.tokenizer, {"concept": concept, "config": config.model_dump(), **info},
                config.max_length).save(folder)
    return ScorerModel.load(folder)


@pytest.fixture
def scorers(tiny_encoder, tmp_path) -> dict[str, ScorerModel]:
    return {"calm": _scorer(tiny_encoder, "calm", {"calm", "warm"}, tmp_path),
            "angry": _scorer(tiny_encoder, "angry", {"angry", "cold"}, tmp_path),
            "quick": _scorer(tiny_encoder, "quick", {"quick", "bright"}, tmp_path)}


def _count_first_block(scorer: ScorerModel, calls: dict[str, int], name: str):
    encoder = scorer.model.encoder
    block = find_decoder_layers(encoder, int(encoder.config.num_hidden_layers))[0]
    return block.register_forward_hook(lambda *_: calls.__setitem__(name, calls.get(name, 0) + 1))


@pytest.mark.numerics  # also under other kernel sets and row-blocked GEMMs (make test's CPU profiles)
def test_equal_to_each_scorer_alone_with_the_frozen_block_run_once(scorers):
    alone = {name: s.score(TEXTS, batch_size=4) for name, s in scorers.items()}
    assert len({a.tobytes() for a in alone.values()}) == 3  # three different classifiers, not one
    assert trunk_groups(scorers) == [["calm", "angry", "quick"]]
    calls: dict[str, int] = {}
    hooks = [_count_first_block(s, calls, name) for name, s in scorers.items()]
    try:
        shared = score_texts(scorers, TEXTS, batch_size=4)
    finally:
        for h in hooks:
            h.remove()
    assert list(shared) == list(scorers)
    for name in scorers:
        assert np.array_equal(shared[name], alone[name]), name
    # 23 texts in batches of 4: the frozen block ran 6 times, in the first scorer only.
    assert calls == {"calm": 6}


def test_a_scorer_with_other_frozen_weights_or_no_training_record_is_scored_alone(scorers, tiny_encoder, tmp_path):
    odd = _scorer(tiny_encoder, "odd", {"dull"}, tmp_path)
    with torch.no_grad():
        odd.model.encoder.embeddings.word_embeddings.weight[5, 0] += 1e-3
    unknown = ScorerModel(scorers["quick"].model, scorers["quick"].tokenizer, {"concept": "unknown"}, 16)
    mixed = {"calm": scorers["calm"], "odd": odd, "unknown": unknown, "angry": scorers["angry"]}
    assert trunk_groups(mixed) == [["calm", "angry"], ["odd"], ["unknown"]]
    shared = score_texts(mixed, TEXTS, batch_size=5)
    assert list(shared) == list(mixed)
    for name, scorer in mixed.items():
        assert np.array_equal(shared[name], scorer.score(TEXTS, batch_size=5)), name
    assert {name: a.shape for name, a in score_texts(mixed, []).items()} == {name: (0,) for name in mixed}
