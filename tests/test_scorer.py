"""Classifier B: fine-tuning on the train split only, held-out validity and refusal of weak scorers,
HF-format storage and reload, one-line errors (its /score endpoint is tested in test_http_app.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from transformers import BertModel

from poolbench.corpus.passage import Passage
from poolbench.records.scorer import ScorerValidity
from poolbench.scorer import artifacts as scorer_artifacts
from poolbench.scorer.artifacts import check_validity, ensure_scorer, load_stored_scorer, scorer_key, scorer_record
from poolbench.scorer.errors import ScorerError, WeakScorerError
from poolbench.scorer.finetune import ScorerConfig
from poolbench.store.local import LocalStore

POS = ["wonderful", "excellent", "superb", "delightful"]
NEG = ["dreadful", "awful", "terrible", "boring"]
FILLER = ["the film", "this book", "our trip", "the meal", "that song", "the show"]


def _passages(n: int, *, informative: bool = True, seed: int = 0) -> list[Passage]:
    rng = random.Random(seed)
    out = []
    for split, k in (("train", n), ("test", n // 2)):
        for i in range(k):
            subject = rng.choice(FILLER)
            for label in (1, 0):
                word = rng.choice(POS if label else NEG) if informative else rng.choice(POS + NEG)
                out.append(Passage(f"{split}-{i}-{label}", f"I think {subject} was {word} overall.", label, "d",
                                   8, f"{split}-{i}", split, "praise"))
    return out


def _config(path: Path, **kw) -> ScorerConfig:
    return ScorerConfig(encoder=str(path), epochs=kw.pop("epochs", 15), lr=3e-3, head_lr=1e-2, batch_size=8,
                        max_length=16, **kw)


def test_scorer_trains_on_train_split_only_and_is_valid(tiny_encoder, tmp_path, monkeypatch):
    passages = _passages(24)
    seen: list[str] = []
    real = scorer_artifacts.fine_tune

    def spy(source, texts, labels, config):
        seen.extend(texts)
        return real(source, texts, labels, config)

    monkeypatch.setattr(scorer_artifacts, "fine_tune", spy)
    store = LocalStore(tmp_path / "store")
    scorer = ensure_scorer(store, "praise", passages, "corpus-h", _config(tiny_encoder))
    test_texts = {p.text for p in passages if p.split == "test"}
    assert seen and len(seen) == 48 and not (set(seen) & test_texts - {p.text for p in passages
                                                                      if p.split == "train"})
    record = scorer_record(scorer)
    assert record.n_train == 48 and record.n_heldout == 24
    assert record.heldout_auroc >= 0.9 and record.valid is True
    assert record.heldout_auroc_ci_low <= record.heldout_auroc <= record.heldout_auroc_ci_high
    assert "top 1 of 2 transformer blocks" in record.fine_tuned
    # results.json carries it as this dict, in this order, and reads it back to the same record.
    written = record.to_dict()
    assert list(written) == ["concept", "encoder", "encoder_hash", "fine_tuned", "trained_params", "total_params",
                             "n_train", "n_heldout", "heldout_accuracy", "heldout_auroc", "heldout_auroc_ci_low",
                             "heldout_auroc_ci_high", "valid", "train_seconds", "key", "min_auroc"]
    assert written["concept"] == "praise" and written["key"] == scorer.info["key"] and written["min_auroc"] == 0.7
    assert json.dumps(ScorerValidity.from_dict(json.loads(json.dumps(written))).to_dict()) == json.dumps(written)
    probs = scorer.score(["I think the film was superb overall.", "I think the film was awful overall."])
    assert probs.shape == (2,) and probs[0] > probs[1]

    # Stored in HF format: the encoder folder loads with AutoModel; a second ensure reads it, no training.
    key = scorer.info["key"]
    folder = store.get_dir(key, tmp_path / "fetched")
    assert (folder / "config.json").is_file() and (folder / "scorer_head.safetensors").is_file()
    BertModel.from_pretrained(folder)
    monkeypatch.setattr(scorer_artifacts, "fine_tune", lambda *a: pytest.fail("retrained a stored scorer"))
    again = ensure_scorer(store, "praise", passages, "corpus-h", _config(tiny_encoder))
    np.testing.assert_allclose(again.score(["I think the film was superb overall."]), probs[:1], rtol=1e-5)


def test_key_depends_on_encoder_corpus_and_config(tiny_encoder):
    passages = _passages(4)
    base = scorer_key("praise", passages, "h1", _config(tiny_encoder))
    assert scorer_key("praise", passages, "h2", _config(tiny_encoder)) != base
    assert scorer_key("praise", passages, "h1", _config(tiny_encoder, epochs=3)) != base
    assert scorer_key("praise", passages, "h1", ScorerConfig()) != base


def test_weak_scorer_refused_in_one_line_unless_allowed(tiny_encoder, tmp_path):
    passages = _passages(12, informative=False)
    store = LocalStore(tmp_path / "store")
    config = _config(tiny_encoder, epochs=2, min_auroc=0.99)
    with pytest.raises(WeakScorerError, match=r"refused: held-out AUROC .* < 0.99") as err:
        ensure_scorer(store, "praise", passages, "h", config)
    assert "\n" not in str(err.value) and "--allow-weak-scorer" in str(err.value)
    weak = ensure_scorer(store, "praise", passages, "h", config, allow_weak=True)
    assert weak.info["valid"] is False
    with pytest.raises(WeakScorerError):
        check_validity(weak, allow_weak=False)


def test_missing_corrupt_or_mislabelled_scorer_artefacts(tiny_encoder, tmp_path):
    store = LocalStore(tmp_path / "store")
    with pytest.raises(ScorerError, match="missing or corrupt"):
        load_stored_scorer(store, "scorer/nothing", "praise")
    scorer = ensure_scorer(store, "praise", _passages(8), "h", _config(tiny_encoder, epochs=1), allow_weak=True)
    with pytest.raises(ScorerError, match="is for concept 'praise', not 'toxicity'"):
        load_stored_scorer(store, scorer.info["key"], "toxicity")
    head = tmp_path / "store" / f"{scorer.info['key']}.dir" / "scorer_head.safetensors"
    head.write_bytes(b"garbage")
    with pytest.raises(ScorerError, match="missing or corrupt") as err:
        load_stored_scorer(store, scorer.info["key"], "praise")
    assert "\n" not in str(err.value)


def test_bad_training_input(tiny_encoder):
    from poolbench.scorer.artifacts import train_scorer

    only_train = [p for p in _passages(4) if p.split == "train"]
    with pytest.raises(ScorerError, match="both train and test"):
        train_scorer("praise", only_train, _config(tiny_encoder))
    with pytest.raises(ScorerError, match="not found: no such folder"):
        train_scorer("praise", _passages(4), ScorerConfig(encoder=str(tiny_encoder / "nope")))


@pytest.mark.slow
def test_minilm_scorer_on_embedded_concept(tmp_path):
    from poolbench.corpus.embedded import generate_concept

    scorer = ensure_scorer(LocalStore(tmp_path / "s"), "imdb_sentiment", generate_concept("imdb_sentiment", "small"),
                           "h", ScorerConfig())
    assert scorer.info["heldout_auroc"] >= 0.9


def test_ensure_scorers_is_ensure_scorer_per_concept_and_reports_each(tiny_encoder, tmp_path):
    from poolbench.corpus.layout import Corpus
    from poolbench.scorer.artifacts import ensure_scorers

    passages = _passages(8)
    corpus = Corpus(tmp_path, ["praise", "other"], {"praise": passages, "other": passages},
                    {"praise": "h-praise", "other": "h-other"})
    store = LocalStore(tmp_path / "store")
    config = _config(tiny_encoder, epochs=1)
    heard: list[tuple[str, float]] = []
    scorers = ensure_scorers(store, corpus, ["praise"], config, allow_weak=True,
                             on_ready=lambda s, seconds: heard.append((s.info["concept"], seconds)))
    assert list(scorers) == ["praise"] and [c for c, _ in heard] == ["praise"] and heard[0][1] > 0
    # The same key ensure_scorer gives the concept on its own: stored once, found again.
    assert scorers["praise"].info["key"] == scorer_key("praise", passages, "h-praise", config)
    again = ensure_scorer(store, "praise", passages, "h-praise", config, allow_weak=True)
    assert again.info["key"] == scorers["praise"].info["key"]
    assert store.list("scorer") == [scorers["praise"].info["key"]]
