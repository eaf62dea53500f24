"""Many narrow L2-logistic probes at once, solved in the primal: S3's head ranking on the probes' GPU.

S3 ranks a layer's heads by the grouped-CV AUROC of one logistic probe a head (supervised.head_aurocs): 32 heads x 3
folds of a head's 128 output features against ~1,100 rows, six rankings a layer. One estimator a fit on the host
(NewtonLogisticProbe) took 2.6 of the 7.3 s of S3's cell at the driver's size on this CPU, one thread beside a GPU;
batched_logistic's solver works in the dual (its systems are rows x rows, made for d 4,096 against n 1,400) and took
ten times the host's time here. Here every (head, fold) fit is one slice of a batch of (d + 1) x (d + 1) Newton
systems: the same objective and stopping rule as fit_l2_logistic (standardised features, C·Σ logloss + |w|²/2 with
an unpenalised intercept, Armijo steps, every |gradient entry| below tol), the intercept solved with the weights in
one Cholesky where the host takes it by a Schur complement: the same optimum, reached within the stopping rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from poolbench.prober.batched_logistic import _padded
from poolbench.prober.distinct_rows import score_distinct_rows
from poolbench.prober.newton_logistic import _ARMIJO, LOGISTIC_C


@dataclass(frozen=True)
class PrimalFits:
    """F fits in each of B cells X [B, n, d]: each fit's standardiser and standardised (coef, intercept)."""

    mean: torch.Tensor  # [B, F, d]
    scale: torch.Tensor  # [B, F, d]
    coef: torch.Tensor  # [B, F, d]
    intercept: torch.Tensor  # [B, F]

    def scores(self, X: torch.Tensor) -> torch.Tensor:
        """[B, F, rows]: NewtonLogisticProbe.decision_function of every fit on its cell's rows, equal rows
        bit-identically (distinct_rows), as the host estimator scores them."""
        return torch.stack([score_distinct_rows(
            lambda rows, b=b: (((rows[None] - self.mean[b][:, None]) / self.scale[b][:, None])
                               @ self.coef[b][:, :, None]).squeeze(-1) + self.intercept[b][:, None], X[b])
            for b in range(X.shape[0])])


def fit_primal(X: torch.Tensor, rows: Sequence[np.ndarray], labels: Sequence[np.ndarray], *, C: float = LOGISTIC_C,
               tol: float = 1e-6, max_iter: int = 100) -> PrimalFits | None:
    """Fit f of every cell b on rows `rows[f]` of X[b] with 0/1 `labels[f]`; None where any fit's Newton matrix
    would not factor or any fit stops at max_iter short of tol (the caller then takes the host estimator, which
    warns for such a fit by name)."""
    cells, _, d = X.shape
    idx, mask, y = _padded(rows, labels, X.device, X.dtype)  # [F, M]: padding points at row 0, mask 0
    weight = mask[None, :, :, None]
    taken = X[:, idx]  # [B, F, M, d]
    count = mask.sum(dim=1)[None, :, None]
    mean = (taken * weight).sum(dim=2) / count
    scale = ((((taken - mean[:, :, None]) ** 2) * weight).sum(dim=2) / count).sqrt()  # population std, as numpy's
    eps = float(torch.finfo(X.dtype).eps)
    scale = torch.where(scale < 10 * eps * mean.abs().clamp(min=1.0), torch.ones_like(scale), scale)
    ones = mask[None].expand(cells, -1, -1)[..., None]
    Z = torch.cat([(taken - mean[:, :, None]) / scale[:, :, None] * weight, ones], dim=3)  # [B, F, M, d + 1]
    penalty = torch.ones(d + 1, dtype=X.dtype, device=X.device)
    penalty[d] = 0.0  # the intercept is not penalised
    theta = torch.zeros(cells, len(rows), d + 1, dtype=X.dtype, device=X.device)

    def margins(t: torch.Tensor) -> torch.Tensor:
        return (Z @ t[..., None]).squeeze(-1)  # [B, F, M]

    def objective(t: torch.Tensor) -> torch.Tensor:
        z = margins(t)
        return C * ((torch.nn.functional.softplus(z) - y * z) * mask).sum(dim=2) + 0.5 * (penalty * t * t).sum(dim=2)

    def gradient(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.sigmoid(margins(t))
        return p, (Z.transpose(2, 3) @ (C * (p - y) * mask)[..., None]).squeeze(-1) + penalty * t

    f = objective(theta)
    active = torch.ones(cells, len(rows), dtype=torch.bool, device=X.device)
    for _ in range(max_iter):
        p, grad = gradient(theta)
        active &= ~(grad.abs().amax(dim=2) < tol)
        if not bool(active.any()):
            return PrimalFits(mean, scale, theta[..., :d], theta[..., d])
        hessian = Z.transpose(2, 3) @ ((C * p * (1 - p) * mask)[..., None] * Z) + torch.diag(penalty)
        factor, info = torch.linalg.cholesky_ex(hessian)
        if bool((info != 0).any()):
            return None
        direction = torch.cholesky_solve(grad[..., None], factor).squeeze(-1) * active[..., None]
        slope = (grad * direction).sum(dim=2)
        step = torch.ones_like(f)
        pending = active.clone()
        while True:
            f_new = objective(theta - step[..., None] * direction)
            pending &= ~((f_new <= f - _ARMIJO * step * slope) | (step < 1e-10))
            if not bool(pending.any()):
                break
            step = torch.where(pending, step * 0.5, step)
        theta = theta - step[..., None] * direction
        f = torch.where(active, f_new, f)
    _, grad = gradient(theta)  # max_iter steps taken: the last one's gradient was never checked
    if bool((grad.abs().amax(dim=2) >= tol).any()):
        return None
    return PrimalFits(mean, scale, theta[..., :d], theta[..., d])
