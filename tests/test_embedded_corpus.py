"""The embedded corpus v1 (selected by version=1): deterministic, balanced, paired where promised, valid, not
separable by one word, and byte-identical to what it always generated. Corpus v2 is tested in test_corpus_v2."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.feature_extraction.text import CountVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

import poolbench.corpus.embedded as ec
from poolbench.corpus.corpus_versions import generate_embedded_corpus
from poolbench.corpus.layout import load_corpus, write_corpus
from poolbench.corpus.passage import Passage
from poolbench.corpus.validation import validate_corpus
from poolbench.errors import CorpusError

ALL_CONCEPTS = sorted(
    [
        "hedging",
        "legal_formality",
        "frustration",
        "numerical_precision",
        "imdb_sentiment",
        "toxicity",
        "depression",
        "causation",
        "contrast",
        "conditionality",
        "negation_density",
        "academic_tone",
        "code_docs",
        "bureaucratic",
        "narrative",
        "deference",
        "planning",
    ]
)
PAIRED = {"hedging", "legal_formality", "causation", "contrast", "conditionality", "negation_density"}
WORD = re.compile(r"[a-z0-9']+")


@pytest.fixture(scope="module")
def small() -> dict[str, list[Passage]]:
    return generate_embedded_corpus("small", version=1)


@pytest.fixture(scope="module")
def tiny() -> dict[str, list[Passage]]:
    return generate_embedded_corpus("tiny", version=1)


def digest(corpus: dict[str, list[Passage]]) -> str:
    records = {c: [p.to_record() for p in ps] for c, ps in corpus.items()}
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()


def test_all_concepts_and_documented() -> None:
    assert list(ec.CONCEPTS) == ALL_CONCEPTS
    for concept in ALL_CONCEPTS:
        assert f"- {concept}" in (ec.__doc__ or "")


def test_deterministic_within_and_across_processes(tiny: dict[str, list[Passage]]) -> None:
    assert generate_embedded_corpus("tiny", version=1) == tiny
    assert generate_embedded_corpus("tiny", seed=1, version=1) != tiny
    code = (
        "import hashlib, json; from poolbench.corpus.corpus_versions import generate_embedded_corpus as g; "
        "c = {k: [p.to_record() for p in v] for k, v in g('tiny', version=1).items()}; "
        "print(hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == digest(tiny)


def test_v1_is_byte_identical_to_what_it_always_generated(tiny, small) -> None:
    # sha256 of the records generated at commit 1fe41b7, before corpus v2 existed: stores and caches rely on it.
    assert digest(tiny) == "50bdb1d5b7ca335ba21812c420c67e263da0fa2242e6710cab9767df34f463e0"
    assert digest(small) == "8cd5c6209b1f34fc817b05c8e79d26d67da0a932f230bf7eb94c7d2c0e7553a8"
    assert all("signal_spans" not in p.to_record() for p in tiny["hedging"])


@pytest.mark.parametrize(("size", "n_train", "n_test"), [("tiny", 24, 12), ("small", 80, 40)])
def test_sizes_balance_ids_and_order(size: str, n_train: int, n_test: int, tiny, small) -> None:
    corpus = tiny if size == "tiny" else small
    assert sorted(corpus) == ALL_CONCEPTS
    for concept, passages in corpus.items():
        files = [(p.split, p.label) for p in passages]
        assert files == (
            [("train", 1)] * n_train
            + [("train", 0)] * n_train
            + [("test", 1)] * n_test
            + [("test", 0)] * n_test
        )
        assert passages[0].id == f"{concept}-train-pos-00000"
        assert passages[-1].id == f"{concept}-test-neg-{n_test - 1:05d}"
        assert len({p.id for p in passages}) == len(passages)
        assert all(p.concept == concept for p in passages)
        domains = {p.domain for p in passages}
        assert len(domains) >= 3, concept


def test_unknown_size_and_concept() -> None:
    with pytest.raises(CorpusError, match="unknown corpus size 'huge'"):
        generate_embedded_corpus("huge", version=1)
    with pytest.raises(CorpusError, match="unknown corpus size 'huge'"):
        generate_embedded_corpus("huge")
    with pytest.raises(CorpusError, match="unknown corpus version 3"):
        generate_embedded_corpus("tiny", version=3)
    with pytest.raises(CorpusError, match="unknown concept 'joy'"):
        ec.generate_concept("joy")


def test_matched_pairs(small: dict[str, list[Passage]]) -> None:
    for concept, passages in small.items():
        if concept not in PAIRED:
            assert all(p.matched_pair_id is None for p in passages), concept
            continue
        by_pair: dict[str, list[Passage]] = {}
        for p in passages:
            assert p.matched_pair_id is not None
            by_pair.setdefault(p.matched_pair_id, []).append(p)
        assert len(by_pair) == 120
        assert f"{concept}-pair-00000" in by_pair and f"{concept}-pair-00119" in by_pair
        for pos, neg in by_pair.values():
            assert (pos.label, neg.label) == (1, 0)
            assert pos.split == neg.split and pos.domain == neg.domain
            assert pos.text != neg.text
            # A controlled rewrite shares most of its words with the positive; a plain-English
            # rewrite of legalese replaces nearly every word, so legal_formality is exempt.
            pos_words, neg_words = set(WORD.findall(pos.text.lower())), set(WORD.findall(neg.text.lower()))
            if concept != "legal_formality":
                assert len(pos_words & neg_words) / len(neg_words) >= 0.5, (pos.text, neg.text)


def test_texts_look_like_sentences(small: dict[str, list[Passage]]) -> None:
    words = []
    for passages in small.values():
        for p in passages:
            assert p.text[0].isupper() and p.text[-1] in ".?!", p.text
            assert "{" not in p.text and "}" not in p.text and "  " not in p.text, p.text
            assert p.token_count == len(p.text.split())
            words.append(p.token_count)
    assert min(words) >= 10 and max(words) <= 90
    assert 15 <= np.median(words) <= 80


def test_tiny_and_small_pass_the_validator(tmp_path: Path, tiny, small) -> None:
    for name, corpus in (("tiny", tiny), ("small", small)):
        write_corpus(tmp_path / name, corpus)
        findings = validate_corpus(tmp_path / name)
        # v1 is not held out (its splits draw one template pool): the only findings are overlap warnings
        assert findings and {(f.severity, f.field) for f in findings} == {("warning", "text")}
        assert all("share a sentence verbatim with train" in f.message for f in findings)
        loaded = load_corpus(tmp_path / name)
        assert loaded.concepts == ALL_CONCEPTS
        assert loaded.passages("hedging") == corpus["hedging"]


def test_small_costs_about_one_draw_a_passage(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation is linear in passages: one unique draw per pair (or per unpaired passage) and few redraws
    (seed 3 takes 3,387 draws for 3,360 slots; the bound allows 5%). Timing belongs in bench/."""
    slots, draws = [0], [0]
    real = ec._unique

    def counted(make, seen, what):
        slots[0] += 1

        def counted_make():
            draws[0] += 1
            return make()

        return real(counted_make, seen, what)

    monkeypatch.setattr(ec, "_unique", counted)
    corpus = generate_embedded_corpus("small", seed=3, version=1)
    passages = sum(len(ps) for ps in corpus.values())
    assert passages / 2 <= slots[0] <= passages
    assert slots[0] <= draws[0] <= 1.05 * slots[0]


@pytest.mark.slow
def test_full_is_valid(tmp_path: Path) -> None:
    corpus = generate_embedded_corpus("full", version=1)
    assert all(len(ps) == 2000 for ps in corpus.values())
    write_corpus(tmp_path, corpus)
    assert validate_corpus(tmp_path) == []


def max_single_token_auroc(passages: list[Passage]) -> tuple[float, str]:
    """The best one-word presence feature, counting a word that marks negatives too (max(a, 1 - a)).

    For a 0/1 feature AUROC = 0.5 + (TPR - FPR) / 2, which ranks all words at once; the winner is
    then scored with sklearn's roc_auc_score, which must agree.
    """
    labels = np.array([p.label for p in passages])
    vectorizer = CountVectorizer(token_pattern=WORD.pattern, binary=True)
    present = vectorizer.fit_transform([p.text for p in passages]).toarray().astype(bool)
    tpr = present[labels == 1].mean(axis=0)
    fpr = present[labels == 0].mean(axis=0)
    closed_form = 0.5 + np.abs(tpr - fpr) / 2
    best = int(np.argmax(closed_form))
    auc = roc_auc_score(labels, present[:, best])
    auc = max(auc, 1 - auc)
    assert auc == pytest.approx(closed_form[best])
    return auc, str(vectorizer.get_feature_names_out()[best])


def test_max_single_token_auroc_hand_computed() -> None:
    def p(text: str, label: int) -> Passage:
        return Passage("x", text, label, "d", 1, None, "train", "c")

    # "may" is in 2 of 2 positives and 1 of 2 negatives: AUROC = (1 + 1 - 0.5) / 2 = 0.75.
    passages = [p("it may rain", 1), p("may it shine", 1), p("it rains", 0), p("may rain stop", 0)]
    auc, _ = max_single_token_auroc(passages)
    assert auc == pytest.approx(0.75)


def test_no_single_word_separates_but_bag_of_words_does(small: dict[str, list[Passage]]) -> None:
    for concept, passages in small.items():
        train = [p for p in passages if p.split == "train"]
        test = [p for p in passages if p.split == "test"]
        auc, word = max_single_token_auroc(train)
        assert auc < 0.98, f"{concept}: the word {word!r} alone reaches train AUROC {auc:.3f}"
        vectorizer = CountVectorizer(token_pattern=WORD.pattern, binary=True)
        x_train = vectorizer.fit_transform([p.text for p in train])
        model = LogisticRegression(max_iter=2000).fit(x_train, [p.label for p in train])
        scores = model.decision_function(vectorizer.transform([p.text for p in test]))
        bow_auc = roc_auc_score([p.label for p in test], scores)
        assert bow_auc >= 0.75, f"{concept}: bag-of-words test AUROC {bow_auc:.3f}"


def test_lm_text(small: dict[str, list[Passage]]) -> None:
    texts = ec.generate_lm_text(300, seed=0)
    assert len(texts) == 300
    assert texts == ec.generate_lm_text(300, seed=0)
    assert texts != ec.generate_lm_text(300, seed=1)
    assert all(t and t[0].isupper() and "{" not in t for t in texts)
    everyday = {"bus", "kitchen", "piano", "park", "dinner", "walked", "weather", "rubbish"}
    assert any(everyday & set(WORD.findall(t.lower())) for t in texts)
    benchmark = {p.text for ps in small.values() for p in ps}
    assert len(benchmark.intersection(texts)) < 30  # a separate stream; templates may collide by chance
