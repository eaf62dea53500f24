"""Classifier B as a stored artefact: train once per (encoder, concept corpus, config), fetch afterwards.

The key hashes the encoder's weights, the concept's corpus hash, the exact passages and the training
config, so a different encoder, corpus or schedule never reuses a scorer it did not produce.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np

from poolbench.corpus.layout import Corpus
from poolbench.corpus.passage import Passage, signal_only
from poolbench.errors import StoreError
from poolbench.records.scorer import ScorerValidity
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import artifact_key

from .encoder import resolve_encoder
from .errors import ScorerError, WeakScorerError
from .finetune import ScorerConfig, fine_tune
from .scorer_model import ScorerModel
from .validity import held_out_validity

SCORER_VERSION = 1


def passages_digest(passages: Sequence[Passage]) -> str:
    """Names the exact passages (ids, splits, labels) a scorer saw; the corpus hash covers their texts."""
    text = "\n".join(f"{p.id}|{p.split}|{p.label}" for p in passages)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def scorer_key(concept: str, passages: Sequence[Passage], corpus_hash: str, config: ScorerConfig,
               encoder_hash: str | None = None) -> str:
    if encoder_hash is None:
        encoder_hash = resolve_encoder(config.encoder)[1]
    return artifact_key("scorer", encoder=encoder_hash, concept=concept, corpus=corpus_hash,
                        passages=passages_digest(passages), config=config.model_dump(mode="json"),
                        version=SCORER_VERSION)


def train_scorer(concept: str, passages: Sequence[Passage], config: ScorerConfig) -> ScorerModel:
    """Fine-tune on the train split; score the test split once for held-out accuracy and AUROC."""
    train = [p for p in passages if p.split == "train"]
    test = [p for p in passages if p.split == "test"]
    if not train or not test:
        raise ScorerError(f"concept '{concept}': scorer needs passages in both train and test splits "
                          f"(got {len(train)} train, {len(test)} test)")
    source, encoder_hash = resolve_encoder(config.encoder)
    tuned = fine_tune(source, [p.text for p in train], [p.label for p in train], config)
    info = {"concept": concept, "encoder": config.encoder, "encoder_hash": encoder_hash,
            "config": config.model_dump(mode="json"), "version": SCORER_VERSION, "n_train": len(train),
            "fine_tuned": tuned.trained, "trained_params": tuned.trained_params,
            "total_params": tuned.total_params, "train_seconds": round(tuned.train_seconds, 3)}
    scorer = ScorerModel(tuned.model, tuned.tokenizer, info, config.max_length)
    probs = scorer.score([p.text for p in test])
    info.update(held_out_validity(probs, np.array([p.label for p in test]),
                                  np.array([p.group for p in test], dtype=object), seed=config.seed))
    info["valid"] = info["heldout_auroc"] >= config.min_auroc
    return scorer


def check_validity(scorer: ScorerModel, allow_weak: bool) -> ScorerModel:
    """Refuse a scorer below the AUROC threshold unless the user accepts weak scorers explicitly."""
    info = scorer.info
    threshold = info["config"]["min_auroc"]
    if info["heldout_auroc"] < threshold and not allow_weak:
        raise WeakScorerError(
            f"scorer for concept '{info['concept']}' refused: held-out AUROC {info['heldout_auroc']:.3f} < "
            f"{threshold:.2f} (pass --allow-weak-scorer / allow_weak=True to use it anyway)")
    return scorer


def load_stored_scorer(store: ArtifactStore, key: str, concept: str = "?") -> ScorerModel:
    """Fetch and verify (sha256 per file) a stored scorer folder, then load it."""
    with tempfile.TemporaryDirectory(prefix="poolbench-scorer-") as tmp:
        try:
            folder = store.get_dir(key, f"{tmp}/scorer")
        except StoreError as exc:
            raise ScorerError(f"scorer artefact {key} for concept '{concept}' is missing or corrupt: "
                              f"{exc}") from exc
        scorer = ScorerModel.load(folder)
        # Weights are read into memory by from_pretrained; the temporary copy can go.
        for p in scorer.model.parameters():
            p.data = p.data.clone()
    if scorer.info.get("concept") != concept and concept != "?":
        raise ScorerError(f"scorer artefact {key} is for concept '{scorer.info.get('concept')}', "
                          f"not '{concept}'")
    return scorer


def ensure_scorer(store: ArtifactStore, concept: str, passages: Sequence[Passage], corpus_hash: str,
                  config: ScorerConfig | None = None, *, allow_weak: bool = False) -> ScorerModel:
    """The stored scorer if there is one, else trained and stored (whole, manifest last); weak ones refused."""
    config = config or ScorerConfig()
    key = scorer_key(concept, passages, corpus_hash, config)
    if store.exists(key):
        scorer = load_stored_scorer(store, key, concept)
    else:
        scorer = train_scorer(concept, passages, config)
        scorer.info["key"] = key
        with tempfile.TemporaryDirectory(prefix="poolbench-scorer-") as tmp:
            scorer.save(tmp)
            store.put_dir(key, tmp, metadata={"concept": concept, "kind": "scorer",
                                              "heldout_auroc": f"{scorer.info['heldout_auroc']:.6f}"})
    scorer.info["key"] = key
    return check_validity(scorer, allow_weak)


def ensure_scorers(store: ArtifactStore, corpus: Corpus, concepts: Sequence[str], config: ScorerConfig | None = None,
                   *, allow_weak: bool = False,
                   on_ready: Callable[[ScorerModel, float], None] | None = None) -> dict[str, ScorerModel]:
    """ensure_scorer for each concept in order, the one way the driver and the CLI get scorers;
    `on_ready(scorer, seconds)` hears each one as soon as it is there. A scorer reads a short window, so it
    trains on each passage's signal sentences where the corpus marks them (unmarked passages as they are), of the
    standard tier only: a hard unit holds both classes' sentences, which a judge of generated text never sees."""
    scorers = {}
    for concept in concepts:
        started = time.perf_counter()
        passages = [signal_only(p) for p in corpus.passages(concept) if p.tier != "hard"]
        scorers[concept] = ensure_scorer(store, concept, passages, corpus.concept_hash(concept), config,
                                         allow_weak=allow_weak)
        if on_ready is not None:
            on_ready(scorers[concept], time.perf_counter() - started)
    return scorers


def scorer_record(scorer: ScorerModel) -> ScorerValidity:
    """The scorer's validity as results.json carries it (one record per concept); info a stored scorer lacks is None."""
    known = {k: scorer.info.get(k) for k in ScorerValidity.model_fields if k != "min_auroc"}
    return ScorerValidity.from_dict({**known, "min_auroc": scorer.info["config"]["min_auroc"]})
