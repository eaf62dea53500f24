"""Corpus v2 (the default) and the calibration family: planted signal at recorded places, every concept paired,
token counts of the default tokenizer, a clean validator, and the known-answer orderings on the tiny model."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from test_embedded_corpus import ALL_CONCEPTS, max_single_token_auroc

from poolbench.corpus import sparse_signal as v2
from poolbench.corpus.calibration import (
    CALIBRATION_CONCEPTS,
    EXPECTATIONS,
    PLANTS,
    SIZE,
    Expectation,
    generate_calibration_corpus,
)
from poolbench.corpus.corpus_versions import DEFAULT_CORPUS_VERSION, generate_embedded_corpus
from poolbench.corpus.layout import load_corpus, write_corpus
from poolbench.corpus.passage import PLACEMENTS, Passage
from poolbench.corpus.source import open_corpus
from poolbench.corpus.token_count import count_tokens
from poolbench.corpus.validation import profile_corpus, validate_corpus


@pytest.fixture(scope="module")
def small() -> dict[str, list[Passage]]:
    return v2.generate_corpus_v2("small")


@pytest.fixture(scope="module")
def tiny() -> dict[str, list[Passage]]:
    return v2.generate_corpus_v2("tiny")


@pytest.fixture(scope="module")
def calibration() -> dict[str, list[Passage]]:
    return generate_calibration_corpus()


def pairs_of(passages: list[Passage]) -> list[tuple[Passage, Passage]]:
    by_pair: dict[str, list[Passage]] = {}
    for p in passages:
        assert p.matched_pair_id is not None
        by_pair.setdefault(p.matched_pair_id, []).append(p)
    return [(pos, neg) for pos, neg in by_pair.values()]


def span_texts(p: Passage) -> list[str]:
    assert p.signal_spans is not None
    return [p.text[a:b] for a, b in p.signal_spans]


def outside(p: Passage) -> str:
    assert p.signal_spans is not None
    text, at, kept = p.text, 0, []
    for a, b in p.signal_spans:
        kept.append(text[at:a])
        at = b
    return "|".join([*kept, text[at:]])


def test_v2_is_the_default_and_deterministic(tiny) -> None:
    assert DEFAULT_CORPUS_VERSION == 2
    assert generate_embedded_corpus("tiny") == tiny
    assert v2.generate_corpus_v2("tiny", seed=1) != tiny
    code = ("import hashlib, json; from poolbench.corpus.corpus_versions import generate_embedded_corpus as g; "
            "c = {k: [p.to_record() for p in v] for k, v in g('tiny').items()}; "
            "print(hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": "7"},
                         capture_output=True, text=True, check=True)
    records = {c: [p.to_record() for p in ps] for c, ps in tiny.items()}
    assert out.stdout.strip() == hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize(("size", "n_train", "n_test"), [("tiny", (16, 8), (4, 8)), ("small", (12, 6), (6, 8))])
def test_sizes_order_pairs_and_domains(size: str, n_train: tuple[int, int], n_test: tuple[int, int], tiny,
                                       small) -> None:
    """(standard, hard) pairs per split; within each file the standard pairs come first."""
    corpus = tiny if size == "tiny" else small
    assert sorted(corpus) == ALL_CONCEPTS
    train = [("train", "standard")] * n_train[0] + [("train", "hard")] * n_train[1]
    test = [("test", "standard")] * n_test[0] + [("test", "hard")] * n_test[1]
    n_train, n_test = len(train), len(test)
    for concept, passages in corpus.items():
        assert [(p.split, p.tier) for p in passages] == train + train + test + test
        assert [p.label for p in passages] == [1] * n_train + [0] * n_train + [1] * n_test + [0] * n_test
        assert passages[-1].id == f"{concept}-test-neg-{n_test - 1:05d}"
        pairs = pairs_of(passages)
        assert len(pairs) == n_train + n_test  # every concept is matched-pair in v2
        for pos, neg in pairs:
            assert (pos.label, neg.label) == (1, 0)
            assert (pos.split, pos.domain, pos.density, pos.placement, pos.tier) == (
                neg.split, neg.domain, neg.density, neg.placement, neg.tier)
        assert len({p.domain for p in passages}) >= 3, concept


def test_signal_sentences_are_rewritten_in_the_same_context(small) -> None:
    for concept, passages in small.items():
        for pos, neg in pairs_of(passages):
            assert pos.density == len(pos.signal_spans or ()) == len(neg.signal_spans or ())
            assert outside(pos) == outside(neg), concept  # the context is shared word for word
            assert all(a != b for a, b in zip(span_texts(pos), span_texts(neg), strict=True)), concept
            for p in (pos, neg):
                assert p.text[0].isupper() and p.text[-1] in ".?!" and "{" not in p.text
                assert all(s[0].isupper() and s[-1] in ".?!" for s in span_texts(p)), (concept, span_texts(p))


def test_placement_puts_the_signal_where_it_says(small) -> None:
    for passages in small.values():
        for p in passages:
            spans = p.signal_spans or ()
            if p.placement == "start":
                assert spans[0][0] == 0
            elif p.placement == "end":
                assert spans[-1][1] == len(p.text)
            elif p.placement == "middle":
                # a contiguous block, with context on both sides
                assert spans[0][0] > 0 and spans[-1][1] < len(p.text)
                assert all(b + 1 == a for (_, b), (a, _) in pairwise(spans))
            else:
                assert p.placement == "spread"
                if p.density > 1:
                    assert spans[0][0] == 0 and spans[-1][1] == len(p.text)


def test_signal_positions_hand_computed() -> None:
    import random

    rng = random.Random(0)
    assert v2.signal_positions(10, 3, "start", rng) == [0, 1, 2]
    assert v2.signal_positions(10, 3, "end", rng) == [7, 8, 9]
    assert v2.signal_positions(10, 2, "middle", rng) == [4, 5]
    assert v2.signal_positions(10, 4, "spread", rng) == [0, 3, 6, 9]
    assert 1 <= v2.signal_positions(10, 1, "spread", rng)[0] <= 8
    text, spans = v2.join_sentences(["the cat sat.", "it rained.", "we left: then home."], [1])
    assert text == "The cat sat. It rained. We left: Then home."
    assert spans == ((13, 23),)


def test_density_and_placement_are_balanced(small) -> None:
    """32 pairs take two full shuffled blocks of the 16 (density, placement) combinations, so every placement
    appears 8 times; a hard pair carries MAX_HARD_DENSITY (one) unit and a split's pool caps a standard one, so
    density is the scheduled one or less."""
    for concept, passages in small.items():
        pos = [p for p in passages if p.label == 1]
        assert Counter(p.placement for p in pos) == dict.fromkeys(PLACEMENTS, 8), concept
        assert {p.density for p in pos if p.tier == "hard"} == {v2.MAX_HARD_DENSITY} == {1}, concept
        assert all(p.density <= max(v2.DENSITIES) for p in pos)
    standard = Counter(p.density for ps in small.values() for p in ps if p.label == 1 and p.tier == "standard")
    assert set(standard) == set(v2.DENSITIES)


def test_token_counts_are_the_default_tokenizers_and_fit_the_window(small) -> None:
    texts = [p.text for ps in small.values() for p in ps]
    counts = [p.token_count for ps in small.values() for p in ps]
    assert counts == count_tokens(texts)
    assert min(counts) >= v2.MIN_TOKENS and max(counts) <= v2.MAX_TOKENS <= 256
    assert 120 <= np.mean(counts) <= 140
    # SmolLM2's tokenizer: "Hello world." is three tokens, no BOS added.
    assert count_tokens(["Hello world."]) == [3]


def test_signal_is_a_minority_of_the_passage(small) -> None:
    """Standard signal sentences stay a minority (context fills what the signal leaves of a length drawn
    independently of density and tier, and revision 2's passages are ~25% shorter to hold 32 pairs in the former
    tokens, so a density-4 passage holds less context: under 45% on average, under 30% at density 1); a hard
    unit's span holds its frame and both sides' sentences, so hard passages are denser but still
    mostly context on average (one unit per passage)."""
    for concept, passages in small.items():
        share = {p.id: sum(b - a for a, b in p.signal_spans or ()) / len(p.text) for p in passages}
        standard = [p for p in passages if p.tier == "standard"]
        ones = [share[p.id] for p in standard if p.density == 1]
        assert max(ones) < 0.3 and np.mean([share[p.id] for p in standard]) < 0.45, concept
        assert np.mean([share[p.id] for p in passages if p.tier == "hard"]) < 0.45, concept


def test_small_passes_the_validator_and_round_trips(tmp_path: Path, small) -> None:
    write_corpus(tmp_path, small)
    assert validate_corpus(tmp_path) == []
    loaded = load_corpus(tmp_path)
    assert loaded.passages("toxicity") == small["toxicity"]  # signal_spans, density and placement survive
    profile = {p.concept: p for p in profile_corpus(tmp_path)}
    assert profile["hedging"].n_passages == 64
    assert sum(profile["hedging"].density.values()) == 64 and set(profile["hedging"].density) == {1, 2, 3, 4}
    assert list(profile["hedging"].placement) == list(PLACEMENTS)
    assert profile["hedging"].token_min >= v2.MIN_TOKENS


def test_no_single_word_separates(tiny) -> None:
    """On 24 train pairs per class; at `small`'s 16 the word 'if' reaches 0.906 on conditionality (sampling)."""
    for concept, passages in tiny.items():
        auc, word = max_single_token_auroc([p for p in passages if p.split == "train"])
        assert auc < 0.9, f"{concept}: the word {word!r} alone reaches train AUROC {auc:.3f}"


def test_open_corpus_selects_the_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POOLBENCH_CACHE", str(tmp_path))
    default = open_corpus("embedded", "tiny", ["hedging"])
    assert default.root.name == f"embedded-v2.{v2.REVISION}-tiny-seed0"
    assert default.passages("hedging")[0].signal_spans is not None
    v1 = open_corpus("embedded-v1", "tiny", ["hedging"])
    assert v1.root.name == "embedded-v1-tiny-seed0"
    assert v1.passages("hedging") == generate_embedded_corpus("tiny", version=1)["hedging"]


def test_small_costs_about_one_draw_a_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation is linear in pairs: one draw_unique_pair per pair and few redraws (seed 3 takes 462 draws
    for 408 pairs; the bound allows 1.5 a pair). Timing belongs in bench/."""
    pairs, draws = [0], [0]
    real = v2.draw_unique_pair

    def counted(make, seen, what):
        pairs[0] += 1

        def counted_make():
            draws[0] += 1
            return make()

        return real(counted_make, seen, what)

    monkeypatch.setattr(v2, "draw_unique_pair", counted)
    corpus = v2.generate_corpus_v2("small", seed=3)
    assert pairs[0] == sum(len(ps) for ps in corpus.values()) // 2
    assert pairs[0] <= draws[0] <= 1.5 * pairs[0]


@pytest.mark.slow
def test_full_is_valid(tmp_path: Path) -> None:
    corpus = v2.generate_corpus_v2("full")
    assert all(len(ps) == 2000 for ps in corpus.values())
    write_corpus(tmp_path, corpus)
    assert validate_corpus(tmp_path) == []


def test_calibration_plants_where_it_says(tmp_path: Path, calibration) -> None:
    assert sorted(calibration) == sorted(CALIBRATION_CONCEPTS)
    assert not set(calibration) & set(ALL_CONCEPTS)
    for concept, passages in calibration.items():
        plant = PLANTS[concept]
        assert len(passages) == 2 * sum(SIZE)
        for pos, neg in pairs_of(passages):
            assert outside(pos) == outside(neg)
            assert pos.density == plant.density and pos.placement == plant.placement
            if plant.placement == "start":
                assert pos.signal_spans[0][0] == 0
            if plant.placement == "end":
                assert pos.signal_spans[-1][1] == len(pos.text)
            if plant.kind == "token":  # one evaluative word differs, nothing else
                a, b = span_texts(pos)[0].split(), span_texts(neg)[0].split()
                assert sum(x != y for x, y in zip(a, b, strict=True)) == 1
    write_corpus(tmp_path, calibration)
    # a known-answer family, not a held-out benchmark: its few planted sentences recur across splits by design
    findings = validate_corpus(tmp_path)
    assert {(f.severity, f.field) for f in findings} == {("warning", "text")}
    assert any(f.message.startswith("48 of 48 test passages share a signal sentence") for f in findings)
    assert generate_calibration_corpus() == calibration


def test_calibration_density_is_not_passage_length(calibration) -> None:
    """Four planted sentences replace context rather than add to it: dense and single-sentence passages are of one
    length (within 5%), so 'the mean falls as density falls' is not 'the mean falls as passages grow'."""
    mean_tokens = {c: np.mean([p.token_count for p in ps]) for c, ps in calibration.items()}
    assert abs(mean_tokens["calibration_dense"] / mean_tokens["calibration_middle"] - 1.0) < 0.05
    assert max(mean_tokens.values()) / min(mean_tokens.values()) < 1.1


def test_unseen_words_never_reach_training(calibration) -> None:
    from poolbench.corpus.calibration import UNSEEN_SPLIT

    words = {split: {w for p in calibration["calibration_unseen_words"] if p.split == split
                     for w in span_texts(p)[0].rstrip(".").split()} for split in ("train", "test")}
    for split, (good, bad) in UNSEEN_SPLIT.items():
        other = "test" if split == "train" else "train"
        assert len(set(good + bad) & words[split]) >= 12 and not set(good + bad) & words[other]


def test_expectation_gap_hand_computed() -> None:
    from poolbench.driver.calibration import expectation_gap

    y = np.array([1, 0, 1, 0, 1, 0])
    groups = np.array(["p0", "p0", "p1", "p1", "p2", "p2"])
    perfect = np.array([3.0, 0.0, 4.0, 1.0, 5.0, 2.0])  # every positive above its every negative: AUROC 1
    flat = np.zeros(6)  # ties everywhere: AUROC 0.5
    half = np.array([1.0, 2.0, 3.0, 0.0, 5.0, 4.0])  # positives 1, 3, 5 beat 1 + 2 + 3 of 9 negatives: 6/9
    scores = {("c", "A"): (perfect, y, groups), ("c", "B"): (flat, y, groups), ("d", "A"): (half, y, groups)}
    paired = expectation_gap(Expectation("e", "A beats B", "c", "A", "c", "B"), scores, n_bootstrap=200, seed=0)
    assert (paired["auroc"], paired["versus_auroc"], paired["gap"]) == (1.0, 0.5, 0.5)
    assert paired["ci_low"] == pytest.approx(0.5) and paired["held"]  # every resample keeps the same gap
    chance = expectation_gap(Expectation("e", "A sees it", "d", "A"), scores, n_bootstrap=200, seed=0)
    assert chance["gap"] == pytest.approx(6 / 9 - 0.5)
    across = expectation_gap(Expectation("e", "c beats d", "c", "A", "d", "A"), scores, n_bootstrap=200, seed=0)
    assert across["gap"] == pytest.approx(1 - 6 / 9)
    assert across["ci_low"] <= across["gap"] <= across["ci_high"]
    reverse = expectation_gap(Expectation("e", "B beats A", "c", "B", "c", "A"), scores, n_bootstrap=200, seed=0)
    assert reverse["gap"] == -0.5 and not reverse["held"]


def test_calibration_wiring_holds_and_meaning_fails_on_the_random_weight_tiny_model(
        tiny_llama_dir: Path, local_ray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from poolbench.driver.calibration import run_calibration

    monkeypatch.setenv("POOLBENCH_CACHE", str(tmp_path / "cache"))
    report = run_calibration(str(tiny_llama_dir), store=str(tmp_path / "store"), n_bootstrap=300)
    assert report["layer"] == 1  # the middle of two layers
    rows = {row["id"]: row for row in report["expectations"]}
    assert list(rows) == [e.id for e in EXPECTATIONS]
    for row in rows.values():
        if not row["trained_only"]:  # wiring: positions, windows, density hold even with random weights
            assert row["held"], row
    # The should-fail case: random weights give unseen evaluative words no meaning, so the probe is at chance.
    assert not rows["unseen_words"]["held"] and rows["unseen_words"]["ci_low"] <= 0.0
    # On a causal LM the first 8 tokens never see a signal planted after them: W1 is exactly at chance.
    assert rows["end_window"]["versus_auroc"] == 0.5


def test_signal_only_keeps_just_the_signal_sentences(small) -> None:
    from poolbench.corpus.passage import signal_only

    p = next(p for p in small["toxicity"] if p.density == 2)
    cut = signal_only(p)
    assert cut.text == " ".join(span_texts(p))
    assert span_texts(cut) == span_texts(p)
    assert (cut.id, cut.label, cut.matched_pair_id, cut.density) == (p.id, p.label, p.matched_pair_id, 2)
    v1 = generate_embedded_corpus("tiny", version=1)["toxicity"][0]
    assert signal_only(v1) is v1
