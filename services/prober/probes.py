"""The two D1 probes as scikit-learn estimators: the class-mean difference direction and L2 logistic.

The logistic probe is one estimator everywhere: D1, seed spread, selectivity, MDL, power and flash all fit
`NewtonLogisticProbe` at `LOGISTIC_C`, so a reliability statistic at D1's seed reproduces D1 exactly.
"""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

from poolbench.prober.auroc import ProbeError
from poolbench.prober.distinct_rows import score_distinct_rows_np
from poolbench.prober.newton_logistic import LOGISTIC_C, NewtonLogisticProbe

PROBE_NAMES = ("logistic", "diffmean")


class DiffMeanProbe(ClassifierMixin, BaseEstimator):
    """The reference's C1: direction = mean(pos) - mean(neg); score = x · direction; no scaling.

    `decision_function` is that projection shifted by the midpoint of the two class means' projections,
    so sklearn's contract holds (score > 0 means the positive class) and AUROC is unchanged.
    """

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.classifier_tags.multi_class = False
        return tags

    def fit(self, X: np.ndarray, y: np.ndarray) -> DiffMeanProbe:
        X, y = validate_data(self, X, y, dtype=np.float64)
        check_classification_targets(y)
        self.classes_ = np.unique(y)
        if self.classes_.size != 2:
            raise ProbeError(
                f"DiffMeanProbe: Only binary classification is supported. Got {self.classes_.size} class(es) "
                f"{self.classes_.tolist()[:5]}"
            )
        is_pos = y == self.classes_[1]
        mean_pos = X[is_pos].mean(axis=0)
        mean_neg = X[~is_pos].mean(axis=0)
        self.direction_ = mean_pos - mean_neg
        self.threshold_ = float(0.5 * (mean_pos + mean_neg) @ self.direction_)
        return self

    def project(self, X: np.ndarray) -> np.ndarray:
        """The raw projection x · direction of the reference's C1."""
        check_is_fitted(self, "direction_")
        X = validate_data(self, X, dtype=np.float64, reset=False)
        return X @ self.direction_

    def decision_function(self, X: np.ndarray) -> np.ndarray:
        """The projection less the midpoint; equal rows score bit-identically (distinct_rows)."""
        check_is_fitted(self, "direction_")
        X = validate_data(self, X, dtype=np.float64, reset=False)
        return score_distinct_rows_np(lambda rows: rows @ self.direction_ - self.threshold_, X)

    def predict(self, X: np.ndarray) -> np.ndarray:
        check_is_fitted(self, "direction_")
        return self.classes_[(self.decision_function(X) > 0).astype(int)]


def make_logistic_probe(seed: int) -> BaseEstimator:
    """Standardise, then L2 logistic at LOGISTIC_C, solved to its optimum by Newton steps (seed-free: convex).

    lbfgs at tol 1e-4 stopped up to 0.003 AUROC short of the optimum that the reliability statistics reach.
    """
    return NewtonLogisticProbe(C=LOGISTIC_C)


def make_probe(name: str, seed: int = 0) -> BaseEstimator:
    """A fresh, unfitted probe by name: "diffmean" or "logistic"."""
    if name == "diffmean":
        return DiffMeanProbe()
    if name == "logistic":
        return make_logistic_probe(seed)
    raise ProbeError(f"unknown probe {name!r}; choose one of {', '.join(PROBE_NAMES)}")
