"""The held-out, two-tier embedded corpus: disjoint train/test pools, hard pairs that hold the same words (so the
lexical baseline cannot separate them), and the validator's one-line findings on overlap, tiers and hard-pair counts."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from sklearn.feature_extraction.text import TfidfVectorizer
from test_cli import assert_one_line_error, driver
from test_corpus import valid_concept, write_concept

from poolbench.corpus import sparse_signal as v2
from poolbench.corpus.layout import MANIFEST_FILE, load_corpus
from poolbench.corpus.passage import TIERS, Passage
from poolbench.corpus.source import write_embedded_corpus
from poolbench.corpus.validation import MIN_HARD_TEST_PAIRS, profile_corpus, split_overlap, validate_corpus
from poolbench.errors import CorpusError
from poolbench.prober.lexical import lexical_baseline

LEXICAL_HARD_MAX = 0.65
SMALL_TOKENS_BEFORE = 137_069
"""Sum of token_count over `small` of corpus v2 revision 1 (16 + 8 pairs per concept), measured before this one;
revision 2 holds 12 + 6 standard and 6 + 8 hard pairs in shorter passages."""


@pytest.fixture(scope="module")
def small() -> dict[str, list[Passage]]:
    return v2.generate_corpus_v2("small")


def words(text: str) -> Counter:
    """The tokens the lexical baseline's TF-IDF sees, counted."""
    return Counter(TfidfVectorizer().build_analyzer()(text))


def tier_lexical(passages: list[Passage], tier: str) -> float:
    train = [p for p in passages if p.split == "train"]
    test = [p for p in passages if p.split == "test" and p.tier == tier]
    return lexical_baseline([p.text for p in train], np.array([p.label for p in train]), [p.text for p in test],
                            np.array([p.label for p in test]), np.array([p.group for p in test]),
                            n_bootstrap=50).test_auroc


def test_split_pool_hand_computed() -> None:
    assert v2.split_pool(list("abcde"), "train") == ["a", "c", "e"]
    assert v2.split_pool(list("abcde"), "test") == ["b", "d"]
    assert v2.split_pool(["only"], "test") == ["only"]


def test_train_and_test_draw_from_disjoint_template_and_filler_pools() -> None:
    for concept in v2.CONCEPTS:
        train, test = v2.SOURCES["train"][concept], v2.SOURCES["test"][concept]
        for domain in train.pairs:
            assert not set(train.pairs[domain]) & set(test.pairs[domain]), concept
            assert not set(train.framed[domain]) & set(test.framed[domain]), concept
            for key, values in train.spec.domains[domain].items():
                if len(v2.SPECS[concept].domains[domain][key]) >= 2:
                    assert not set(values) & set(test.spec.domains[domain][key]), (concept, key)
        assert not set(train.hard) & set(test.hard), concept
        assert train.hard or train.framed, concept


def test_no_signal_sentence_is_shared_between_train_and_test(small) -> None:
    for concept, passages in small.items():
        spans = {split: {p.text[a:b].lower() for p in passages if p.split == split for a, b in p.signal_spans or ()}
                 for split in ("train", "test")}
        assert not spans["train"] & spans["test"], concept
        n_test = sum(p.split == "test" for p in passages)
        assert split_overlap(p.to_record() for p in passages) == (0, n_test, 0), concept


def test_every_record_has_a_tier_and_every_concept_enough_hard_test_pairs(small) -> None:
    for concept, passages in small.items():
        assert {p.tier for p in passages} == set(TIERS), concept
        hard_test = Counter(p.label for p in passages if p.split == "test" and p.tier == "hard")
        assert hard_test == {1: 8, 0: 8} and MIN_HARD_TEST_PAIRS <= 8, concept


def test_every_hard_template_holds_the_same_words() -> None:
    """Each hand-written pair and each framed pair, with every slot as one token: the same word multiset."""
    def slotted(template: str) -> Counter:
        return words(re.sub(r"\{([^}]*)\}", lambda m: " slot" + re.sub(r"\W", "", m.group(1)) + " ", template))

    templates = [pair for pairs in v2.HARD.HARD_PAIRS.values() for pair in pairs]
    templates += [pair for split in v2.SOURCES.values() for source in split.values()
                  for pairs in source.framed.values() for pair in pairs]
    for pos, neg in templates:
        assert pos != neg and slotted(pos) == slotted(neg), (pos, neg)
    assert set(v2.HARD.HARD_PAIRS) <= set(v2.CONCEPTS)


def test_hard_pairs_hold_the_same_words(small) -> None:
    """The tier's defining property: a hard positive and its negative differ, yet hold the same word multiset."""
    n = 0
    for concept, passages in small.items():
        by_pair: dict[str, list[Passage]] = {}
        for p in passages:
            if p.tier == "hard":
                by_pair.setdefault(str(p.matched_pair_id), []).append(p)
        for pos, neg in by_pair.values():
            assert pos.text != neg.text and words(pos.text) == words(neg.text), (concept, pos.text, neg.text)
            n += 1
    assert n == 17 * (6 + 8)


def test_lexical_baseline_cannot_separate_the_hard_tier(small) -> None:
    """Identical word multisets give identical TF-IDF vectors, so each hard pair's two scores are equal and the
    positives' scores are the negatives' multiset: AUROC exactly 0.5 (<= 0.65 is the issue's bar)."""
    for concept, passages in small.items():
        value = tier_lexical(passages, "hard")
        assert value <= LEXICAL_HARD_MAX, concept
        assert value == pytest.approx(0.5, abs=1e-12), concept


def test_the_lexical_bar_fails_where_words_do_separate(small) -> None:
    """The same check on the standard tier: there words give several concepts away (causation's connectives)."""
    standard = {concept: tier_lexical(passages, "standard") for concept, passages in small.items()}
    assert standard["causation"] > LEXICAL_HARD_MAX
    assert sum(v > LEXICAL_HARD_MAX for v in standard.values()) >= 5


def test_small_keeps_its_token_budget(small) -> None:
    total = sum(p.token_count for ps in small.values() for p in ps)
    assert abs(total - SMALL_TOKENS_BEFORE) / SMALL_TOKENS_BEFORE < 0.05


def test_the_embedded_corpus_is_validated_as_held_out(tmp_path: Path) -> None:
    root = tmp_path / "embedded"
    write_embedded_corpus(root, "tiny", 0)
    assert json.loads((root / MANIFEST_FILE).read_text())["held_out"] is True
    assert validate_corpus(root) == []
    # plant one train signal sentence in a test passage: held-out corpora make that an error naming the count
    train = json.loads((root / "hedging" / "train_pos.jsonl").read_text().splitlines()[0])
    a, b = train["signal_spans"][0]
    path = root / "hedging" / "test_pos.jsonl"
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    c, d = first["signal_spans"][0]
    first["text"] = first["text"][:c] + train["text"][a:b] + first["text"][d:]
    shift = (b - a) - (d - c)
    first["signal_spans"] = [[c, c + b - a], *([s + shift, e + shift] for s, e in first["signal_spans"][1:])]
    path.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    findings = [f for f in validate_corpus(root) if f.field == "text"]
    assert [(f.severity, f.file) for f in findings] == [("error", "hedging")]
    assert findings[0].message.startswith("1 of 24 test passages share a signal sentence verbatim with train")


def test_a_users_overlapping_splits_get_a_warning_with_counts(tmp_path: Path) -> None:
    records = valid_concept()
    records["test_pos"][1]["text"] = "Arguably the tax cut helps. Perhaps the merger lifts sales."
    records["test_neg"][1]["text"] = "The tax cut helps. Perhaps the merger lifts sales."
    write_concept(tmp_path / "c", records)
    [finding] = validate_corpus(tmp_path / "c")
    assert (finding.severity, finding.file, finding.field) == ("warning", "alpha", "text")
    assert finding.message.startswith("2 of 4 test passages share a sentence verbatim with train (1 distinct)")


def _tiered(tiers: dict[str, list[str]]) -> dict[str, list[dict]]:
    records = valid_concept()
    for stem, values in tiers.items():
        for row, tier in zip(records[stem], values, strict=False):
            row["tier"] = tier
    return records


def test_a_tier_of_another_value_is_one_line_naming_concept_and_count(tmp_path: Path) -> None:
    records = _tiered({"train_pos": ["medium", "medium", "standard"], "train_neg": ["medium", "standard"]})
    root = tmp_path / "c"
    write_concept(root, records)
    tier_findings = [f for f in validate_corpus(root) if f.field == "tier"]
    assert [(f.severity, f.file) for f in tier_findings] == [("error", "alpha")]
    assert tier_findings[0].message.startswith("3 record(s) with tier 'medium' (first at alpha/train_pos.jsonl:1)")
    from poolbench.driver.pipeline import check_corpus

    with pytest.raises(CorpusError, match=r"^alpha: tier: 3 record\(s\) with tier 'medium'") as info:
        check_corpus(load_corpus(root))
    assert "\n" not in str(info.value)


def test_too_few_hard_pairs_for_an_interval(tmp_path: Path) -> None:
    records = _tiered({"test_pos": ["hard", "standard"], "test_neg": ["hard", "standard"]})
    write_concept(tmp_path / "c", records)
    [finding] = validate_corpus(tmp_path / "c")
    assert (finding.severity, finding.file, finding.field) == ("error", "alpha", "tier")
    assert finding.message.startswith(f"1 hard test pair(s) (1 positive, 1 negative); a hard-tier interval needs "
                                      f">= {MIN_HARD_TEST_PAIRS}")


def test_pair_members_must_share_a_tier(tmp_path: Path) -> None:
    records = _tiered({"test_pos": ["standard"], "test_neg": ["hard"]})
    write_concept(tmp_path / "c", records)
    fields = {(f.severity, f.field) for f in validate_corpus(tmp_path / "c")}
    assert ("error", "tier") in fields


def test_run_stops_on_a_bad_tier_before_writing_anything(tmp_path: Path) -> None:
    records = _tiered({"test_pos": ["easy", "easy"], "test_neg": ["easy"]})
    write_concept(tmp_path / "c", records)
    out = tmp_path / "out"
    result = driver("run", "--corpus", str(tmp_path / "c"), "--out", str(out), "--no-steering")
    assert_one_line_error(result, "alpha", "3 record(s) with tier 'easy'")
    assert not (out / "results.json").exists() and not (out / "leaderboard.json").exists()


def test_corpus_build_writes_a_held_out_manifest_and_validates_clean(tmp_path: Path) -> None:
    out = tmp_path / "built"
    result = driver("corpus", "build", "--out", str(out), "--size", "tiny")
    assert result.returncode == 0, result.stderr
    assert "wrote 1224 passages of 17 concepts" in result.stdout  # 17 x (24 + 12) pairs x 2
    assert json.loads((out / MANIFEST_FILE).read_text())["held_out"] is True
    checked = driver("validate-corpus", str(out))
    assert checked.returncode == 0 and "0 error(s), 0 warning(s)" in checked.stdout, checked.stdout[-2000:]
    [hedging] = [p for p in profile_corpus(out) if p.concept == "hedging"]
    assert hedging.tier == {"standard": 2 * (16 + 4), "hard": 2 * (8 + 8)}
