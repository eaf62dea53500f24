"""The lexical baseline: TF-IDF + logistic held-out AUROC, 1.0 when vocabulary separates the classes, exactly 0.5
when both classes use the same words, and the scores of a two-passage fit worked out by hand."""

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.special import expit

from poolbench.corpus.passage import Passage
from poolbench.prober.auroc import ProbeError
from poolbench.prober.lexical import lexical_baseline, lexical_record
from poolbench.prober.newton_logistic import LOGISTIC_C

FILLER = ["the report was filed on tuesday", "a train left the station", "the committee met at noon",
          "rain fell over the harbour", "the library opens at nine", "a clerk sorted the letters"]
POSITIVE = ["delighted", "wonderful", "splendid", "joyful", "marvellous"]
NEGATIVE = ["dreadful", "miserable", "awful", "gloomy", "wretched"]


def passages(pairs: list[tuple[str, str]], split: str, start: int = 0) -> list[Passage]:
    """A matched pair per (positive text, negative text), sharing its id and split."""
    out = []
    for i, (pos, neg) in enumerate(pairs, start=start):
        for label, text in ((1, pos), (0, neg)):
            out.append(Passage(id=f"{split}{i}-{label}", text=text, label=label, domain="d",
                               token_count=len(text.split()), matched_pair_id=f"pair{i}", split=split, concept="c"))
    return out


def test_vocabulary_that_separates_the_classes_gives_auroc_one():
    """Positives carry only POSITIVE words and negatives only NEGATIVE ones, in shared filler: every test positive
    outscores every test negative, so AUROC is 1; the CI is flagged and is Wilson's on min(4, 4) units."""
    pairs = [(f"{FILLER[i % 6]} and it was {POSITIVE[i % 5]}", f"{FILLER[i % 6]} and it was {NEGATIVE[i % 5]}")
             for i in range(12)]
    record = lexical_record("c", passages(pairs[:8], "train") + passages(pairs[8:], "test", start=8),
                            n_bootstrap=200)
    assert (record.test_auroc, record.ci_high) == (1.0, 1.0) and record.ci_degenerate
    assert record.ci_low == pytest.approx(4 / (4 + 1.959963984540054**2))
    assert (record.n_train, record.n_test, record.C) == (16, 8, LOGISTIC_C)


def test_the_same_words_in_another_order_give_exactly_chance():
    """Each negative is its positive's words reordered: unigram TF-IDF vectors of a pair are identical, so any fitted
    model scores both alike, the positives' scores are the negatives' scores as multisets, and the Mann-Whitney
    AUROC is 0.5 exactly (every cross-pair comparison has its mirror image) however the probe was fitted."""
    words = ["dog", "cat", "bird", "horse", "fox", "owl", "goat", "mouse", "hare", "crow"]
    pairs = [(f"the {words[i]} chased the {words[(i + 3) % 10]} near the river bank",
              f"the {words[(i + 3) % 10]} chased the {words[i]} near the river bank") for i in range(10)]
    record = lexical_record("c", passages(pairs[:6], "train") + passages(pairs[6:], "test", start=6),
                            n_bootstrap=200)
    assert record.test_auroc == pytest.approx(0.5, abs=1e-12)
    assert record.ci_low <= 0.5 <= record.ci_high


def test_two_passage_fit_by_hand():
    """Train "good" (pos) and "bad" (neg): TF-IDF maps them to e_good and e_bad (equal idf, l2 norm), and by symmetry
    the optimum of |w|^2/2 + C * logloss is w = (-a, +a), b = 0 with a = C * (1 - sigmoid(a)) (C = 1: a = 0.40106).
    A test text with counts (bad, good) scores a * (good - bad) / sqrt(bad^2 + good^2), unknown words dropped."""
    assert LOGISTIC_C == 1.0
    a = brentq(lambda v: v - LOGISTIC_C * (1.0 - expit(v)), 0.0, 1.0)
    result = lexical_baseline(["good", "bad"], np.array([1, 0]),
                              ["good good bad", "bad bad good film", "good bad", "bad bad bad good"],
                              np.array([1, 1, 0, 0]), np.array(["p", "q", "r", "s"]), n_bootstrap=100)
    expected = [a / np.sqrt(5), -a / np.sqrt(5), 0.0, -2 * a / np.sqrt(10)]
    np.testing.assert_allclose(result.test_scores, expected, atol=1e-6)
    # positives (+0.179, -0.179) against negatives (0, -0.254): 3 of the 4 comparisons go the positive's way
    assert result.test_auroc == 0.75
    assert (result.n_train, result.n_test, result.n_features) == (2, 4, 2)


def test_one_train_class_is_one_line():
    with pytest.raises(ProbeError, match="one class only"):
        lexical_baseline(["good", "fine"], np.array([1, 1]), ["bad"], np.array([0]), np.array(["g"]))
