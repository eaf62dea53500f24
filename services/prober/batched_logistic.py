"""Many L2-logistic fits over the rows of one matrix, solved together as tensor work (torch, any device).

Each fit is `fit_l2_logistic`'s: its rows standardised by their own mean and std, C·Σ logloss + |w|²/2 with an
unpenalised intercept, stopped once every |gradient entry| < tol (the gradient in float64, as today's). The
reparametrisation v = w/σ_f, z = (x − μ₀)·v + c (μ₀ the universe's mean) makes every fit a logistic on the SAME
centred matrix Xc = X − μ₀ with a diagonal penalty ½ Σ σ_f² v²: centring is free (the intercept is unpenalised, so
c absorbs μ_f − μ₀ exactly) and only the per-fit scale σ_f stays per fit. Scores, gradients and the objective are
then GEMMs of Xc with all fits' vectors at once ([n, d] × [d, F]).

Arithmetic per cell, n = 1,400 train rows, m ≈ 0.8 n per fold fit, d = 4,096, F = 31 fits on the train rows:
- today: per fit a Gram Z Zᵀ (2 m² d ≈ 10 GFLOP) and per Newton step a Cholesky (m³/3 ≈ 0.47 GFLOP, ~6 steps):
  ≈ 31 × 13 ≈ 400 GFLOP a cell, on one core.
- here: one Gram G = Xc diag(σ₀⁻²) Xcᵀ of the train rows (2 n² d ≈ 16 GFLOP, shared by every fold, seed and
  control fit); a fold's Newton direction uses H̃ = diag(σ₀²) + XcᵀDXc in place of its H = diag(σ_f²) + XcᵀDXc,
  whose dual matrix I + S G_ff S is a gather from G (no per-fit Gram). H̃ is SPD, so each step is a descent step
  (Armijo on the exact objective), and ‖I − H̃⁻¹H‖ ≤ max_k |1 − σ_f,k²/σ₀,k²| (a few % for an 80% fold), so
  the iteration converges to the same optimum at a linear rate of a few % on top of Newton's; only the stopping
  rule decides where it ends, and it is today's. Cost: F × steps × m³/3 of batched Cholesky plus ~6 GEMMs of
  2 n d F (≈ 0.36 GFLOP) per step: ≈ 60-90 GFLOP a cell, on every core (or the GPU) at once.
- small fits (MDL's prefixes) get their own exact Gram (`exact=True`): cheap at m ≤ n/2.
- precision: objective, gradient, stop and scores in float64 on every device; on a CPU the Cholesky factor (the
  search direction only) is float32, made and solved in place by scipy's LAPACK (lapack_factors: torch's copies
  around each factorization cost ~10% of a cell), on CUDA float64 (an H100's float64 is ~60 TFLOP/s).
Measured (bench/README, "D1 at the width of the machine"): 7.9 CPU-s a cell against 16.0 for the per-fit path.

Cells: X may be [B, n, d], B cells (strategies of one layer) whose fits share their rows and labels, only the
features differing: every tensor then carries B in front, the GEMMs are batched ones and the Cholesky factors of all
B·F fits are one batched call, so a layer's cells cost one Newton loop's host dispatch instead of B (on a GPU the
loop's Python and launches, not the arithmetic, were the cell's time: bench/measured/h100_session20). Each fit's
iterates are those it takes alone (every step rule is per fit), up to the GEMMs' rounding.

Equality with today's fits: both stop at |∇F|∞ < tol, so each is within ‖θ − θ*‖₂ ≤ √(d+1)·tol / λ_min(H) of the
optimum; the L2 term makes λ_min of the w-block ≥ 1, the intercept's curvature is C·Σp(1−p) on top. A passage's
score differs by at most ‖(x̃, 1)‖₂ times twice that; AUROCs are equal unless two scores lie within that gap.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from poolbench.prober.distinct_rows import score_distinct_rows
from poolbench.prober.lapack_factors import factor_in_place, solve
from poolbench.prober.newton_logistic import LOGISTIC_C, NewtonLogisticProbe, UnconvergedFitWarning

_ARMIJO = 1e-4
_REFRESH = 0.2  # refactor a fit's Newton matrix unless its gradient fell at least 5-fold in the last step
_FLOAT32_FACTOR_ON_CPU = True
_SHARED_EXTRA_STEPS = 10  # the shared Gram's extra Newton steps over exact ones, as exact_is_cheaper counts them
_CANCELLED = 1e13  # E[xc²] − E[xc]² kept fewer than ~3 of float64's 16 digits: take that variance in two passes
_CHUNK_ENTRIES = 16 * 1400 * 1400  # entries of one [F, M, M] dual matrix (~250 MB at float64)
_CHUNK_ENTRIES_CUDA = 2 ** 27  # on a GPU (1 GiB at float64): a layer's 19 cells × 25 folds in 5 slices
FIT_COUNTER = {"calls": 0, "fits": 0, "refits": 0}  # tests read it: the batched path must not fall back to one fit
# per call; "refits": fits the batched solver could not bring to its stopping rule, fitted again one at a time
REFIT_MAX_ITER = 100  # the per-fit path's (fit_l2_logistic's) own


@dataclass(frozen=True)
class BatchFit:
    """F fits of one universe X: each fit's standardiser (mean, scale) and standardised (coef, intercept), the
    Newton steps each took, and the centred parametrisation (v = coef/scale, c) that scores any row cheaply.
    Shapes as below for X [n, d]; for B cells' X [B, n, d] each field has B in front."""

    mean: torch.Tensor  # [F, d]
    scale: torch.Tensor  # [F, d]
    coef: torch.Tensor  # [F, d], in standardised units, as NewtonLogisticProbe.coef_
    intercept: torch.Tensor  # [F]
    iterations: torch.Tensor  # [F]
    factorizations: torch.Tensor  # [F] Cholesky factorizations of the fit's Newton matrix
    converged: torch.Tensor  # [F] bool: the fit met the stopping rule (else max_iter, or no step descended)
    center: torch.Tensor  # [d] μ₀
    v: torch.Tensor  # [F, d]
    c: torch.Tensor  # [F]

    def scores(self, X: torch.Tensor) -> torch.Tensor:
        """[F, rows]: every fit's decision score ((x − mean)/scale)·coef + intercept of every row of X, equal rows
        bit-identically (distinct_rows: a GEMM's tiles would round them apart and AUROC would count the pair).
        For B cells, X [B, rows, d] and [B, F, rows], each cell's rows scored by its own fits."""
        if self.center.ndim == 2:
            return torch.stack([_scores(self.center[b], self.v[b], self.c[b], X[b]) for b in range(X.shape[0])])
        return _scores(self.center, self.v, self.c, X)

    def cell(self, b: int) -> BatchFit:
        """Cell b's fits of a B-cell BatchFit, as a one-universe BatchFit."""
        return BatchFit(*(getattr(self, name)[b] for name in BatchFit.__dataclass_fields__))

    def cells(self) -> BatchFit:
        """This one-universe BatchFit as a batch of one cell."""
        return BatchFit(*(getattr(self, name)[None] for name in BatchFit.__dataclass_fields__))


def _scores(center: torch.Tensor, v: torch.Tensor, c: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """[F, rows] (x − μ₀)·v + c of the distinct rows of X, spread back to X's rows."""
    return score_distinct_rows(lambda rows: ((rows - center) @ v.T + c).T, X)


def standardisers(X: torch.Tensor, member: torch.Tensor, center: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per fit (mean, scale) of its rows as NewtonLogisticProbe takes them (population std, near-constant → 1).

    `member` [F, n] is 1 on a fit's rows (X [B, n, d] and center [B, d]: each cell's, [B, F, d] out); variances are
    taken about μ₀ and shifted (E[xc²] − E[xc]², GEMMs), which
    loses nothing where a fit's spread is not tiny beside its offset from μ₀. Where it is (a feature constant or
    nearly so in a fit but not in the universe: W1_first_k's and P2_first's shared first tokens, MDL's short
    prefixes), the shift cancels all but round-off, ~eps·E[xc²], and a feature NewtonLogisticProbe finds constant
    (std 0, scale 1) would get a spurious scale ~√eps·|offset|, a different and ill-conditioned problem. Those
    entries are taken again in two passes about the fit's own mean, as numpy's std takes them. (A guard from the
    arithmetic, not the cause of the 28 MDL calls short of the stopping rule on make run's stored tables: that was
    the shared Newton factor, fixed in _fit.)"""
    if X.ndim == 2:
        mean, scale = standardisers(X[None], member, center[None])
        return mean[0], scale[0]
    m = member.sum(dim=1, keepdim=True)
    Xc = X - center[:, None, :]
    mean_c = (member @ Xc) / m  # [B, F, d]
    second = (member @ (Xc * Xc)) / m
    var = (second - mean_c * mean_c).clamp_min(0.0)
    lost = var <= _CANCELLED * torch.finfo(X.dtype).eps * second  # [B, F, d]: the shift kept fewer than ~3 digits
    for b, f in lost.any(dim=2).nonzero().tolist():
        cols = lost[b, f].nonzero().flatten()
        rows = member[f].nonzero().flatten()
        dev = Xc[b].index_select(0, rows).index_select(1, cols) - mean_c[b, f, cols]
        var[b, f, cols] = (dev * dev).mean(dim=0)
    mean = mean_c + center[:, None, :]
    scale = var.sqrt()
    eps = float(torch.finfo(X.dtype).eps)
    return mean, torch.where(scale < 10 * eps * torch.clamp(mean.abs(), min=1.0), torch.ones_like(scale), scale)


def _padded(rows: Sequence[np.ndarray], labels: Sequence[np.ndarray], device: torch.device,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row indices [F, M] (padding points at row 0), a 0/1 mask [F, M] and labels [F, M], M the largest fit."""
    M = max(len(r) for r in rows)
    idx = np.zeros((len(rows), M), dtype=np.int64)
    mask = np.zeros((len(rows), M))
    y = np.zeros((len(rows), M))
    for f, (r, lab) in enumerate(zip(rows, labels, strict=True)):
        idx[f, :len(r)] = r
        mask[f, :len(r)] = 1.0
        y[f, :len(r)] = lab
    as_t = lambda a, t: torch.as_tensor(a, device=device, dtype=t)  # noqa: E731
    return as_t(idx, torch.int64), as_t(mask, dtype), as_t(y, dtype)


def fit_many(X: torch.Tensor, rows: Sequence[np.ndarray], labels: Sequence[np.ndarray], *, C: float = LOGISTIC_C,
             tol: float = 1e-6, max_iter: int = 200, exact: bool | None = None,
             init: BatchFit | None = None, gram: tuple[torch.Tensor, torch.Tensor] | None = None) -> BatchFit:
    """Fit F L2-logistic probes, fit f on rows `rows[f]` of X [n, d] with 0/1 `labels[f]`, all at once; for X
    [B, n, d] the same F fits in each of B cells (module docstring), a B-cell BatchFit.

    `exact`: each fit's Newton matrix from its own Gram (quadratic convergence; for small fits). Otherwise the
    shared Gram of all n rows at their common scale (`gram` = (G, σ₀²) when the caller has it) stands in.
    None: exact where its Grams cost less than the iterations it saves (exact_is_cheaper).
    `init`: a one-fit BatchFit (the all-train fit) whose scores every fit starts from."""
    if X.ndim == 2:
        fit = fit_many(X[None], rows, labels, C=C, tol=tol, max_iter=max_iter, exact=exact,
                       init=None if init is None else init.cells(),
                       gram=None if gram is None else (gram[0][None], gram[1][None]))
        return fit.cell(0)
    if exact is None and exact_is_cheaper(X.shape[1], max(len(r) for r in rows)):
        try:
            return fit_many(X, rows, labels, C=C, tol=tol, max_iter=max_iter, exact=True, init=init, gram=gram)
        except torch.linalg.LinAlgError:
            # A fit's own Gram is built from the universe-centred rows at its own scale: a column nearly constant
            # in the fit but not in the universe gives it a huge rank-one part that round-off can leave not
            # positive definite (seen on the tiny model's 8-row folds in float32); the shared Gram, at the
            # universe's scale, has none. Deterministic: the same inputs take the same path (for B cells, all of
            # them: one cell's failed factor sends the batch to the shared Gram).
            pass
    exact = bool(exact)
    FIT_COUNTER["calls"] += 1  # once per call, after the choice above (whose own call counts itself)
    FIT_COUNTER["fits"] += X.shape[0] * len(rows)
    entries = _CHUNK_ENTRIES_CUDA if X.is_cuda else _CHUNK_ENTRIES
    per_chunk = max(1, entries // (X.shape[0] * max(len(r) for r in rows) ** 2))
    if len(rows) > per_chunk:  # the [B, F, M, M] dual matrices in slices that fit memory
        parts = [_fit(X, rows[k:k + per_chunk], labels[k:k + per_chunk], C, tol, max_iter, exact, init, gram)
                 for k in range(0, len(rows), per_chunk)]
        fit = BatchFit(*(torch.cat([getattr(p, name) for p in parts], dim=1) if name != "center"
                         else parts[0].center for name in BatchFit.__dataclass_fields__))
    else:
        fit = _fit(X, rows, labels, C, tol, max_iter, exact, init, gram)
    short = int((~fit.converged).sum())  # one read of the device a call where every fit converged
    if short:
        fit = _refit_one_at_a_time(X, rows, labels, fit, C, tol)
        short = int((~fit.converged).sum())
    if short:
        warnings.warn(f"{short} of {fit.converged.numel()} logistic fits stopped at max_iter={max_iter} with "
                      f"|gradient| still >= tol={tol:g}, and again one at a time (max_iter={REFIT_MAX_ITER}): their "
                      "scores are those of the last step", UnconvergedFitWarning, stacklevel=2)
    return fit


def _refit_one_at_a_time(X: torch.Tensor, rows: Sequence[np.ndarray], labels: Sequence[np.ndarray], fit: BatchFit,
                         C: float, tol: float) -> BatchFit:
    """The fits the batched solver left short of its stopping rule, fitted by the per-fit path (NewtonLogisticProbe,
    each fit's rows centred and scaled by their own statistics) and put back in the batch's parametrisation.

    Why: the batched solver works in the universe's centring; a fit whose features are near-constant in its rows but
    not in the universe (MDL's 4-row first prefix on frustration layer 12 A2_max) gets a Newton matrix so
    ill-conditioned that no step descends, and the line search's old last resort, a 1e-10 step taken anyway, sent
    its coefficients to inf (MDL compression 1.2131 against the per-fit path's 1.2114). On make run's stored tables
    this is one fit in all; the per-fit path is the reference the batched one must equal, so such fits take it."""
    out = {name: getattr(fit, name).clone() for name in BatchFit.__dataclass_fields__}
    for b, f in (~fit.converged).nonzero().tolist():
        FIT_COUNTER["refits"] += 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UnconvergedFitWarning)
            model = NewtonLogisticProbe(C=C, tol=tol, max_iter=REFIT_MAX_ITER).fit(
                X[b][torch.as_tensor(rows[f], device=X.device)].cpu().numpy(), np.asarray(labels[f]))
        as_t = lambda a: torch.as_tensor(a, device=X.device, dtype=X.dtype)  # noqa: E731
        mean, scale, coef = as_t(model.mean_), as_t(model.scale_), as_t(model.coef_)
        v = coef / scale
        out["mean"][b, f], out["scale"][b, f], out["coef"][b, f], out["v"][b, f] = mean, scale, coef, v
        out["intercept"][b, f] = float(model.intercept_)
        out["c"][b, f] = float(model.intercept_) + ((fit.center[b] - mean) * v).sum()
        out["converged"][b, f] = not any(issubclass(w.category, UnconvergedFitWarning) for w in caught)
    return BatchFit(**out)


def exact_is_cheaper(n: int, m: int) -> bool:
    """Whether F fits of m of n rows are cheaper with their own Grams (2·F·m²·d, then Newton's ~6 steps) than
    with the shared one, whose linear rate costs ~_SHARED_EXTRA_STEPS more steps of ~6 GEMMs of 2·n·d·F each:
    2·m²·d ≤ 12·n·d·steps, i.e. m² ≤ 6·steps·n, d and F cancelling. True for make run's cells (n = 36, m = 29:
    841 ≤ 2,160; the shared Gram took up to 77 steps there), false from n ≈ 90 on (the full corpus: n = 1,400)."""
    return m * m <= 6 * _SHARED_EXTRA_STEPS * n


def _fit(X: torch.Tensor, rows: Sequence[np.ndarray], labels: Sequence[np.ndarray], C: float, tol: float,
         max_iter: int, exact: bool, init: BatchFit | None,
         gram: tuple[torch.Tensor, torch.Tensor] | None) -> BatchFit:
    """The Newton loop of fit_many over B cells' X [B, n, d]: per fit quantities are [B, F, ...]; the factors and
    their solves run on the flattened [B·F, M, M]."""
    dev, dt = X.device, X.dtype
    cells, n, d = X.shape
    F = len(rows)
    P = cells * F
    idx, mask, y = _padded(rows, labels, dev, dt)
    M = idx.shape[1]
    idx_b = idx.expand(cells, F, M)
    member = torch.zeros(F, n, device=dev, dtype=dt).scatter_add_(1, idx, mask)
    center = X.mean(dim=1)  # [B, d]
    Xc = X - center[:, None, :]
    mean, scale = standardisers(X, member, center)
    shift = mean - center[:, None, :]
    pen = scale * scale  # [B, F, d] the penalty's diagonal in v-units
    # The factor only shapes the search direction (every step is checked on the float64 objective, and the stop
    # is the float64 gradient's), so on a CPU it is float32: half the Cholesky, solve and memory traffic, a
    # direction off by ~cond(B)·eps32 ≈ 1e-3 relative, which the next steps absorb. A GPU's float64 is fast enough.
    # An exact (own-Gram) factor is small (m² ≤ 60 n, or MDL's prefixes) and its Gram the worse conditioned: float64.
    factor_dtype = torch.float32 if dev.type == "cpu" and _FLOAT32_FACTOR_ON_CPU and not exact else dt
    # Those float32 factors are made and used in place by LAPACK (lapack_factors: torch's CPU Cholesky copies and
    # zeroes each [F, M, M] batch around the factorization); the exact path's float64 ones stay torch's, so make
    # run's fits (all exact) keep their bits.
    in_place = dev.type == "cpu" and factor_dtype == torch.float32
    G = None
    if exact:
        ref = pen
        own = [Xc.index_select(1, idx[f]) for f in range(F)]  # each fit's rows of every cell, [B, M, d]
        K = torch.stack([((rows / ref[:, f, None, :]) @ rows.transpose(1, 2)).to(factor_dtype)
                         for f, rows in enumerate(own)], dim=1)  # [B, F, M, M]
    else:
        if gram is None:
            gram = shared_gram(X)
        G, ref0 = gram
        ref = ref0[:, None, :].expand(cells, F, d)
        K = G.to(factor_dtype)[:, idx[:, :, None], idx[:, None, :]]  # [B, F, M, M]: gathers, exact
    K = K.reshape(P, M, M)
    v = torch.zeros(cells, F, d, device=dev, dtype=dt)
    c = torch.zeros(cells, F, device=dev, dtype=dt)
    if init is not None:
        v = init.v.expand(cells, F, d).clone()
        c = init.c + ((init.center - center)[:, None, :] * init.v).sum(dim=2)
        c = c.expand(cells, F).clone()
        cold = _cold_start_stops(Xc, idx, mask, y, shift, scale, C, tol)
        v[cold], c[cold] = 0.0, 0.0
    z_all = Xc @ v.transpose(1, 2) + c[:, None, :]  # [B, n, F]
    iterations = torch.zeros(cells, F, dtype=torch.int64, device=dev)
    active = torch.ones(cells, F, dtype=torch.bool, device=dev)
    stalled = torch.zeros(cells, F, dtype=torch.bool, device=dev)

    def own_rows(z: torch.Tensor) -> torch.Tensor:
        """[B, F, M]: each fit's scores of its own rows, from scores of every row [B, n, F]."""
        return z.transpose(1, 2).gather(2, idx_b)

    def objective(z: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        zz = own_rows(z)
        loss = (torch.nn.functional.softplus(zz) - y * zz) * mask
        return C * loss.sum(dim=2) + 0.5 * (pen * vv * vv).sum(dim=2)

    f_val = objective(z_all, v)
    # A tensor of its own, not eye's expanded view: `L[sel] = ...` below writes into it where some fits are already
    # converged at the first step (a cold start that meets the rule), and a write into an expanded view lands in
    # the one shared matrix, handing every fit the last one's factor.
    L = torch.eye(M, device=dev, dtype=factor_dtype).repeat(P, 1, 1)
    factorizations = torch.zeros(cells, F, dtype=torch.int64, device=dev)
    last_grad = torch.full((cells, F), float("inf"), device=dev, dtype=dt)
    u = torch.zeros(cells, F, d, device=dev, dtype=dt)
    curv = torch.zeros(cells, F, M, device=dev, dtype=dt)
    idx2 = idx.repeat(2, 1).expand(cells, 2 * F, M)
    ref2 = ref.repeat(1, 2, 1)  # [B, 2F, d]
    for _ in range(max_iter):
        grad, p, xtr, g_b = _gradient(Xc, idx, mask, y, own_rows(z_all), shift, scale, v, C)
        active &= ~(grad < tol)
        # A fit's Newton matrix is refactored when its gradient fell less than _REFRESH-fold in the last step
        # (curvature still moving); otherwise the last factor serves again: a descent direction either way.
        stale = active & ((factorizations == 0) | (grad > _REFRESH * last_grad))
        # How many fits go on and how many refactor, in one read of the device (each read waits for the device's
        # queue: on a GPU beside an extractor, a wait for its time slice), where three reads took them one by one.
        n_active, n_stale = _counts(active, stale)
        if not n_active:
            break
        iterations += active.long()
        last_grad = grad
        if n_stale:
            new_curv = C * p * (1 - p) * mask
            curv = torch.where(stale[:, :, None], new_curv, curv)
            sel = torch.nonzero_static(stale.flatten(), size=n_stale).squeeze(1)  # its size known: no read
            sq = curv.reshape(P, M)[sel].sqrt().to(factor_dtype)
            Bm = (K if n_stale == P else K[sel]) * (sq[:, :, None] * sq[:, None, :])
            Bm.diagonal(dim1=1, dim2=2).add_(1.0)
            factors = factor_in_place(Bm) if in_place else torch.linalg.cholesky(Bm)
            if n_stale == P:
                L = factors
            else:
                L[sel] = factors
            if cells == 1:  # the stale fits' rows only (one cell: a plain GEMM of them)
                f_sel = sel
                u[0, f_sel] = torch.zeros(len(sel), n, device=dev, dtype=dt).scatter_add_(
                    1, idx[f_sel], curv[0, f_sel]) @ Xc[0]
            else:
                weights = torch.zeros(cells, F, n, device=dev, dtype=dt).scatter_add_(2, idx_b, curv)
                u = torch.where(stale[:, :, None], weights @ Xc, u)
            factorizations += stale.long()
        s = curv.sqrt()
        g_v = xtr + pen * v
        rhs = torch.cat([g_v, u], dim=1) / ref2  # P̃⁻¹ [g_v; u]: [B, 2F, d]
        proj = (Xc @ rhs.transpose(1, 2)).transpose(1, 2)  # [B, 2F, n]
        s2 = s.repeat(1, 2, 1)
        t = (s2 * proj.gather(2, idx2)).reshape(cells, 2, F, M).permute(0, 2, 3, 1).reshape(P, M, 2)
        t = t.to(factor_dtype).contiguous()
        t = (s.reshape(P, M, 1) * (solve(L, t) if in_place else torch.cholesky_solve(t, L)).to(dt))  # [B·F, M, 2]
        t = t.reshape(cells, F, M, 2).permute(0, 3, 1, 2).reshape(cells, 2 * F, M)
        back = torch.zeros(cells, 2 * F, n, device=dev, dtype=dt).scatter_add_(2, idx2, t)
        a_inv = (rhs - (back @ Xc) / ref2).reshape(cells, 2, F, d).permute(0, 2, 3, 1)  # Ã⁻¹ [g_v, u]
        schur = (curv.sum(dim=2) - (u * a_inv[..., 1]).sum(dim=2)).clamp_min(1e-300)
        dc = (g_b - (u * a_inv[..., 0]).sum(dim=2)) / schur
        dv = a_inv[..., 0] - a_inv[..., 1] * dc[:, :, None]
        dv = dv * active[:, :, None]
        dc = dc * active
        slope = (g_v * dv).sum(dim=2) + g_b * dc
        if G is None:
            dz = Xc @ dv.transpose(1, 2) + dc[:, None, :]  # [B, n, F]
        else:  # Xc·Ã⁻¹y = Xc·P̃⁻¹y − G·back: the product with Xc (n·d) becomes one with G (n·n)
            Xa = (proj - back @ G).reshape(cells, 2, F, n)
            dz = ((Xa[:, 0] - Xa[:, 1] * dc[:, :, None]) * active[:, :, None]).transpose(1, 2) + dc[:, None, :]
        step = torch.ones(cells, F, device=dev, dtype=dt)
        pending = active.clone()
        while True:
            f_new = objective(z_all - step[:, None, :] * dz, v - step[:, :, None] * dv)
            descent = f_new <= f_val - _ARMIJO * step * slope
            pending &= ~(descent | (step < 1e-10))
            # No step down to 1e-10 decreased the objective: the direction is not a descent direction in floating
            # point (an ill-conditioned Newton matrix). Such a fit stays where it is and stops, not converged. Read
            # with the round's pending fits: the last round's count is the one that stands.
            stuck = active & ~descent
            n_pending, n_stuck = _counts(pending, stuck)
            if not n_pending:
                break
            step = torch.where(pending, step * 0.5, step)
        if n_stuck:
            step = torch.where(stuck, torch.zeros_like(step), step)
            f_new = torch.where(stuck, f_val, f_new)
            stalled |= stuck
            active &= ~stuck
        v = v - step[:, :, None] * dv
        c = c - step * dc
        z_all = z_all - step[:, None, :] * dz
        f_val = torch.where(active, f_new, f_val)
    else:  # max_iter steps taken: the last one's gradient was never checked
        grad = _gradient(Xc, idx, mask, y, own_rows(z_all), shift, scale, v, C)[0]
        active &= ~(grad < tol)
    coef = scale * v
    intercept = c + (shift * v).sum(dim=2)
    return BatchFit(mean=mean, scale=scale, coef=coef, intercept=intercept, iterations=iterations,
                    factorizations=factorizations, converged=~active & ~stalled, center=center, v=v, c=c)


def _counts(first: torch.Tensor, second: torch.Tensor) -> tuple[int, int]:
    """(first.sum(), second.sum()) of two boolean masks in one read of the device: one packed integer."""
    both = int((first.sum() * (second.numel() + 1) + second.sum()).item())
    return both // (second.numel() + 1), both % (second.numel() + 1)


def _gradient(Xc: torch.Tensor, idx: torch.Tensor, mask: torch.Tensor, y: torch.Tensor, zz: torch.Tensor,
              shift: torch.Tensor, scale: torch.Tensor, v: torch.Tensor,
              C: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(|gradient|∞ [B, F], p [B, F, M], Xcᵀr [B, F, d], the intercept's gradient [B, F]) of every fit at scores
    zz [B, F, M] of its rows: fit_l2_logistic's gradient in standardised units, which its stopping rule reads."""
    p = torch.sigmoid(zz)
    r = C * (p - y) * mask  # [B, F, M]
    cells, F, M = r.shape
    r_full = torch.zeros(cells, F, Xc.shape[1], device=Xc.device, dtype=Xc.dtype).scatter_add_(
        2, idx.expand(cells, F, M), r)
    xtr = r_full @ Xc  # [B, F, d]
    g_b = r.sum(dim=2)
    g_w = (xtr - shift * g_b[:, :, None]) / scale + scale * v
    return torch.maximum(g_w.abs().amax(dim=2), g_b.abs()), p, xtr, g_b


def _cold_start_stops(Xc: torch.Tensor, idx: torch.Tensor, mask: torch.Tensor, y: torch.Tensor,
                      shift: torch.Tensor, scale: torch.Tensor, C: float, tol: float) -> torch.Tensor:
    """[B, F] True where a fit's cold start (coef 0, intercept 0: fit_l2_logistic's first point) already meets the
    stopping rule. Such a fit stays there, as the per-fit path does: a balanced fold whose rows carry no signal has
    its optimum at 0 and every score tied, while a warm start would stop a stopping rule's width from 0 with scores
    ~1e-6 apart that AUROC orders (make run: toxicity P2_first fold 1, 0.656 instead of 0.5)."""
    zero = torch.zeros(Xc.shape[0], *mask.shape, device=Xc.device, dtype=Xc.dtype)
    return _gradient(Xc, idx, mask, y, zero, shift, scale, torch.zeros_like(scale), C)[0] < tol


def shared_gram(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, σ₀²): the Gram of the centred rows of X at the all-rows fit's own scale σ₀, so that fit is exact Newton
    and every other fit of X gathers its dual matrix from G. X [B, n, d]: each cell's ([B, n, n], [B, d])."""
    if X.ndim == 2:
        G, ref = shared_gram(X[None])
        return G[0], ref[0]
    center = X.mean(dim=1)
    _, scale = standardisers(X, torch.ones(1, X.shape[1], device=X.device, dtype=X.dtype), center)
    ref = scale[:, 0] * scale[:, 0]
    Xc = X - center[:, None, :]
    return (Xc / ref[:, None, :]) @ Xc.transpose(1, 2), ref
