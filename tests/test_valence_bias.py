"""Valence bias: hand-computed valence, ΔValence, ΔVar, bootstrap CIs; word-list errors; the demo."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from poolbench.prober.valence_bias import ValenceBiasError, delta_var, valence, valence_bias
from poolbench.valence_words import (
    DEFAULT_DOMAIN,
    DEFAULT_NEGATIVE,
    DEFAULT_POSITIVE,
    WordListError,
    load_word_list,
    parse_word_list,
)


def test_valence_by_hand():
    domain = np.array([[1.0, 0], [0, 2], [1, 1], [3, 1]])
    positive = np.array([[1.0, 0], [2, 0]])
    negative = np.array([[0.0, 1]])
    # cos to P = [1, 0, 1/√2, 3/√10]; cos to N = [0, 1, 1/√2, 1/√10]
    expected = [1, -1, 0, 2 / math.sqrt(10)]
    np.testing.assert_allclose(valence(domain, positive, negative), expected)


def test_delta_valence_and_delta_var_by_hand():
    before = np.array([0.1, 0.1, 0.1, 0.1])
    after = np.array([0.5, 0.1, 0.1, 0.1])
    result = valence_bias(before, after, n_bootstrap=500, seed=0)
    assert result.delta_valence.value == pytest.approx(0.1)
    # after: mean 0.2, deviations [0.3, -0.1, -0.1, -0.1] -> var (0.09 + 3 * 0.01) / 4 = 0.03
    assert result.delta_var.value == pytest.approx(0.03)
    assert delta_var(np.array([1.0, 3.0]), np.array([0.0, 0.0])) == pytest.approx(-1.0)


def test_bootstrap_is_paired_and_seeded():
    rng = np.random.default_rng(1)
    before = rng.normal(size=30)
    shifted = valence_bias(before, before + 0.2, n_bootstrap=300, seed=4)
    # a uniform shift: every resample has ΔValence exactly 0.2 and ΔVar exactly 0 (pairing)
    assert shifted.delta_valence.ci_low == pytest.approx(0.2)
    assert shifted.delta_valence.ci_high == pytest.approx(0.2)
    assert shifted.delta_var.ci_low == pytest.approx(0, abs=1e-12)
    assert shifted.delta_var.ci_high == pytest.approx(0, abs=1e-12)
    spread = valence_bias(before, before * 2, n_bootstrap=300, seed=4)
    assert spread.delta_var.excludes_zero and spread.delta_var.ci_low > 0
    again = valence_bias(before, before * 2, n_bootstrap=300, seed=4)
    assert again.delta_var.ci_low == spread.delta_var.ci_low


def test_bad_inputs():
    with pytest.raises(ValenceBiasError, match="zero representation"):
        valence(np.zeros((1, 2)), np.ones((1, 2)), np.ones((1, 2)))
    with pytest.raises(ValenceBiasError, match="D >= 2"):
        valence_bias(np.zeros(1), np.zeros(1))


def test_word_lists(tmp_path: Path):
    domain = load_word_list(None, DEFAULT_DOMAIN)
    assert domain.words[0] == "chair" and len(domain.words) >= 20
    assert {"love", "adore"} <= set(load_word_list(None, DEFAULT_POSITIVE).words)
    assert {"hate", "disgust"} <= set(load_word_list(None, DEFAULT_NEGATIVE).words)
    words = parse_word_list("# header\n\nsofa\ncoffee table  # a phrase\n", "mine.txt")
    assert words.words == ("sofa", "coffee table") and words.where(1) == "mine.txt:4"
    (tmp_path / "empty.txt").write_text("# nothing here\n\n")
    with pytest.raises(WordListError, match=r"empty\.txt: word list is empty"):
        load_word_list(tmp_path / "empty.txt", DEFAULT_DOMAIN)
    with pytest.raises(WordListError, match=r"dup\.txt:3: word 'sofa' already listed on line 1"):
        parse_word_list("sofa\nbed\nsofa\n", "dup.txt")
    with pytest.raises(WordListError, match=r"missing\.txt: cannot read"):
        load_word_list(tmp_path / "missing.txt", DEFAULT_DOMAIN)
