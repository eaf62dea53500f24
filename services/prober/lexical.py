"""The lexical baseline: a TF-IDF bag of words and an L2 logistic regression at the probes' C, train -> test.

A concept the bag of words already separates says little about pooling; read beside D1 it tells how much of a
concept is vocabulary. Texts in, numbers out; no model, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from poolbench.corpus.passage import Passage
from poolbench.prober.auroc import AUROC_CI_METHOD, ProbeError, auroc, auroc_ci
from poolbench.prober.newton_logistic import LOGISTIC_C
from poolbench.records.lexical import LexicalBaselineRecord

FEATURES = "TF-IDF of lowercased unigrams (scikit-learn defaults: l2 norm, smoothed idf), vocabulary from train"


@dataclass(frozen=True)
class LexicalResult:
    """Held-out AUROC of the bag-of-words probe, its CI, and the per-passage scores behind it."""

    test_auroc: float
    ci_low: float
    ci_high: float
    ci_level: float
    n_train: int
    n_test: int
    n_bootstrap: int
    n_features: int
    test_scores: np.ndarray = field(repr=False)
    ci_degenerate: bool = False


@dataclass(frozen=True)
class LexicalFit:
    """The bag-of-words probe fitted on one concept's train split: scores any texts, so the per-tier baselines
    score their tiers with the concept's one fit (the same fit they each refitted before, bit for bit: TF-IDF and
    the decision function work a text at a time)."""

    vectorizer: TfidfVectorizer
    model: LogisticRegression
    n_train: int

    @property
    def n_features(self) -> int:
        return len(self.vectorizer.vocabulary_)

    def scores(self, texts: Sequence[str]) -> np.ndarray:
        return np.asarray(self.model.decision_function(self.vectorizer.transform(texts)), dtype=np.float64)


def fit_lexical(train_texts: Sequence[str], y_train: np.ndarray) -> LexicalFit:
    """Fit TF-IDF + logistic (C = LOGISTIC_C, unpenalised intercept) on the train texts."""
    y_train = np.asarray(y_train)
    if len(train_texts) != y_train.size:
        raise ProbeError("lexical baseline: texts and labels differ in length")
    if np.unique(y_train).size != 2:
        raise ProbeError(f"lexical baseline: train labels hold one class only ({np.unique(y_train).tolist()})")
    vectorizer = TfidfVectorizer()
    try:
        X_train = vectorizer.fit_transform(train_texts)
    except ValueError as exc:  # every train text empty or stop-word only
        raise ProbeError(f"lexical baseline: {exc}") from None
    model = LogisticRegression(C=LOGISTIC_C, solver="lbfgs", tol=1e-10, max_iter=10_000)
    model.fit(X_train, y_train)
    return LexicalFit(vectorizer, model, int(y_train.size))


def lexical_baseline(train_texts: Sequence[str], y_train: np.ndarray, test_texts: Sequence[str], y_test: np.ndarray,
                     groups_test: np.ndarray, *, n_bootstrap: int = 1000, seed: int = 0,
                     ci_level: float = 0.95) -> LexicalResult:
    """Fit TF-IDF + logistic on train, score test; the CI resamples `groups_test` (matched pairs) as D1's does."""
    if len(test_texts) != np.asarray(y_test).size:
        raise ProbeError("lexical baseline: texts and labels differ in length")
    return score_lexical(fit_lexical(train_texts, y_train), test_texts, y_test, groups_test,
                         n_bootstrap=n_bootstrap, ci_level=ci_level)


def score_lexical(fit: LexicalFit, test_texts: Sequence[str], y_test: np.ndarray, groups_test: np.ndarray, *,
                  n_bootstrap: int = 1000, ci_level: float = 0.95) -> LexicalResult:
    """A fitted lexical probe's held-out AUROC on the test texts and its pair-clustered CI."""
    y_test = np.asarray(y_test)
    if len(test_texts) != y_test.size:
        raise ProbeError("lexical baseline: texts and labels differ in length")
    scores = fit.scores(test_texts)
    ci = auroc_ci(scores, y_test, groups_test, ci_level)
    return LexicalResult(test_auroc=auroc(scores, y_test), ci_low=ci.low, ci_high=ci.high, ci_level=ci_level,
                         n_train=fit.n_train, n_test=int(y_test.size), n_bootstrap=n_bootstrap,
                         n_features=fit.n_features, test_scores=scores, ci_degenerate=ci.degenerate)


def train_fit(passages: Sequence[Passage]) -> LexicalFit:
    """The lexical probe of one concept's train split."""
    train = [p for p in passages if p.split == "train"]
    return fit_lexical([p.text for p in train], np.array([p.label for p in train]))


def lexical_record(concept: str, passages: Sequence[Passage], *, n_bootstrap: int = 1000, seed: int = 0,
                   ci_level: float = 0.95, fit: LexicalFit | None = None) -> LexicalBaselineRecord:
    """The lexical baseline of one concept's passages (train split -> test split), as results.json keeps it;
    `fit`: train_fit(passages), where the caller has it."""
    test = [p for p in passages if p.split == "test"]
    result = score_lexical(fit if fit is not None else train_fit(passages), [p.text for p in test],
                           np.array([p.label for p in test]), np.array([p.group for p in test]),
                           n_bootstrap=n_bootstrap, ci_level=ci_level)
    return LexicalBaselineRecord(concept=concept, test_auroc=result.test_auroc, ci_low=result.ci_low,
                                 ci_high=result.ci_high, ci_level=result.ci_level, n_train=result.n_train,
                                 n_test=result.n_test, n_bootstrap=result.n_bootstrap,
                                 n_features=result.n_features, C=LOGISTIC_C, features=FEATURES,
                                 ci_method=AUROC_CI_METHOD, ci_degenerate=result.ci_degenerate)
