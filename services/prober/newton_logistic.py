"""The logistic probe (standardise, L2 logistic at LOGISTIC_C) solved by Newton steps: D1's and reliability's.

The reliability statistics refit the probe ~40 times per cell; sklearn's lbfgs pays ~7 ms of per-iteration
overhead per fit at 128x256 and stops at tol 1e-4, short of the optimum. This solves the same convex objective,
C * sum(logloss) + |w|^2 / 2 with an unpenalised intercept, in 5-8 Newton steps to a gradient below 1e-6; when
passages are fewer than features (the usual cell) each step is an n x n Cholesky via Woodbury. Tests compare
the optimum with scikit-learn's LogisticRegression at a tight tolerance.
"""

from __future__ import annotations

import warnings

import numpy as np
from scipy.linalg import cho_factor, cho_solve
from scipy.special import expit
from sklearn.base import BaseEstimator, ClassifierMixin

from poolbench.prober.auroc import ProbeError
from poolbench.prober.distinct_rows import score_distinct_rows_np

LOGISTIC_C = 1.0  # inverse L2 strength of the one logistic probe (D1 and every reliability statistic)
_ARMIJO = 1e-4


class UnconvergedFitWarning(UserWarning):
    """A logistic fit took max_iter steps without its gradient falling below tol: its scores are the last step's,
    not the optimum's. The probe loop names the cell (concept_probe); a run never reports such a fit silently."""


def _objective(X: np.ndarray, y: np.ndarray, w: np.ndarray, b: float, C: float) -> float:
    z = X @ w + b
    return float(C * np.sum(np.logaddexp(0.0, z) - y * z) + 0.5 * w @ w)


def _newton_direction(X: np.ndarray, K: np.ndarray | None, curv: np.ndarray, g_w: np.ndarray,
                      g_b: float) -> tuple[np.ndarray, float]:
    """Solve [[X'DX + I, X'd], [d'X, sum d]] [dw, db] = [g_w, g_b] with D = diag(curv)."""
    u = X.T @ curv
    if K is not None:  # n <= d: (I + X'DX)^-1 v = v - X' S (I + S K S)^-1 S X v, S = D^1/2
        s = np.sqrt(curv)
        factor = cho_factor(np.eye(K.shape[0]) + s[:, None] * K * s[None, :], lower=True, check_finite=False)

        def a_inv(v: np.ndarray) -> np.ndarray:
            return v - X.T @ (s * cho_solve(factor, s * (X @ v), check_finite=False))
    else:
        factor = cho_factor(np.eye(X.shape[1]) + X.T @ (curv[:, None] * X), lower=True, check_finite=False)

        def a_inv(v: np.ndarray) -> np.ndarray:
            return cho_solve(factor, v, check_finite=False)
    ainv_g, ainv_u = a_inv(g_w), a_inv(u)
    schur = max(float(curv.sum() - u @ ainv_u), 1e-300)
    db = (g_b - u @ ainv_g) / schur
    return ainv_g - ainv_u * db, float(db)


def fit_l2_logistic(X: np.ndarray, y: np.ndarray, C: float = LOGISTIC_C, tol: float = 1e-6, max_iter: int = 100,
                    init: tuple[np.ndarray, float] | None = None) -> tuple[np.ndarray, float]:
    """(coef, intercept) minimising C * sum logloss + |coef|^2 / 2; stops once every |gradient entry| < tol.

    `init` warm-starts from a nearby solution (a fold's fit from the all-train fit): fewer Newton steps.
    """
    n, d = X.shape
    y = y.astype(np.float64)
    K = X @ X.T if n <= d else None
    w, b = (np.zeros(d), 0.0) if init is None else (np.array(init[0], dtype=np.float64), float(init[1]))
    f = _objective(X, y, w, b, C)
    for _ in range(max_iter):
        p, g_w, g_b = _gradient(X, y, w, b, C)
        if max(float(np.max(np.abs(g_w))), abs(g_b)) < tol:
            break
        dw, db = _newton_direction(X, K, C * p * (1.0 - p), g_w, g_b)
        slope = float(g_w @ dw + g_b * db)
        step = 1.0
        while True:
            w_new, b_new = w - step * dw, b - step * db
            f_new = _objective(X, y, w_new, b_new, C)
            if f_new <= f - _ARMIJO * step * slope or step < 1e-10:
                break
            step *= 0.5
        w, b, f = w_new, b_new, f_new
    else:  # max_iter steps taken: the last one's gradient was never checked
        _, g_w, g_b = _gradient(X, y, w, b, C)
        if max(float(np.max(np.abs(g_w))), abs(g_b)) >= tol:
            warnings.warn(f"1 of 1 logistic fits stopped at max_iter={max_iter} with |gradient| still >= tol={tol:g}: "
                          "its scores are those of the last step", UnconvergedFitWarning, stacklevel=2)
    return w, b


def _gradient(X: np.ndarray, y: np.ndarray, w: np.ndarray, b: float, C: float) -> tuple[np.ndarray, np.ndarray, float]:
    """(p, ∇w, ∂b) of C·Σ logloss + |w|²/2 at (w, b)."""
    p = expit(X @ w + b)
    r = C * (p - y)
    return p, X.T @ r + w, float(r.sum())


class NewtonLogisticProbe(ClassifierMixin, BaseEstimator):
    """StandardScaler + L2 LogisticRegression(C) in one estimator, fitted by `fit_l2_logistic`."""

    def __init__(self, C: float = LOGISTIC_C, tol: float = 1e-6,
                 init: tuple[np.ndarray, float] | None = None, max_iter: int = 100) -> None:
        self.C = C
        self.tol = tol
        self.init = init
        self.max_iter = max_iter

    def fit(self, X: np.ndarray, y: np.ndarray) -> NewtonLogisticProbe:
        X = np.asarray(X, dtype=np.float64)
        y = np.asarray(y)
        self.classes_ = np.unique(y)
        if self.classes_.size != 2:
            raise ProbeError(f"NewtonLogisticProbe: needs two classes, got {self.classes_.tolist()[:5]}")
        self.mean_ = X.mean(axis=0)
        scale = X.std(axis=0)
        self.scale_ = np.where(scale < 10 * np.finfo(np.float64).eps * np.maximum(1.0, np.abs(self.mean_)),
                               1.0, scale)
        self.coef_, self.intercept_ = fit_l2_logistic((X - self.mean_) / self.scale_,
                                                      (y == self.classes_[1]), self.C, self.tol,
                                                      max_iter=self.max_iter, init=self.init)
        return self

    def decision_function(self, X: np.ndarray) -> np.ndarray:
        """Equal rows score bit-identically (distinct_rows): ties stay ties for AUROC."""
        return score_distinct_rows_np(lambda rows: ((rows - self.mean_) / self.scale_) @ self.coef_ + self.intercept_,
                                      np.asarray(X, dtype=np.float64))

    def predict(self, X: np.ndarray) -> np.ndarray:
        return self.classes_[(self.decision_function(X) > 0).astype(int)]

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        p = expit(self.decision_function(X))
        return np.c_[1.0 - p, p]

