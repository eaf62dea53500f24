"""Fitting learned aggregators inside the D1 folds: the outer fits (one per CV fold of the train split, on that
fold's training part, and one on the whole train split for the held-out test), each with its grid point and step
count chosen by an inner grouped CV on its own rows only (nested CV; early stopping on the inner folds).

The outer folds are StratifiedGroupKFold(n_folds, shuffle=True, random_state=seed) over the train split's labels
and matched-pair groups: the folds D1 uses (poolbench.prober.fast_folds reproduces them). The prober checks that
each fit's training passages are exactly a D1 fold's, so a fold plan that drifted from D1's stops the probe
instead of leaking. Every (outer fit, grid point, inner fold) model trains at once in one AggregatorBank, each on
its own rows (a per-model row weight), so the nested CV costs one batched run. Pure torch and scikit-learn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.model_selection import StratifiedGroupKFold

from poolbench.pooler.learned_aggregators import AggregatorBank, AggregatorParams

INNER_FOLDS = 3


@dataclass(frozen=True)
class TrainSettings:
    """The optimiser's budget: full-batch Adam, L2 on the readout weights, a validation check every few steps."""

    max_steps: int = 100
    check_every: int = 10
    lr: float = 0.02
    l2: float = 1e-3


@dataclass
class TokenBatch:
    """Right-padded token states of some passages: Z [N, T, d], mask [N, T] bool, relative position [N, T]."""

    Z: torch.Tensor
    mask: torch.Tensor
    position: torch.Tensor


def pad_tokens(states: Sequence[torch.Tensor]) -> TokenBatch:
    """Per-passage token states [T_i, d] (real tokens only) as one right-padded batch (ordinary tensors, even
    when the states were kept under inference mode)."""
    lengths = torch.tensor([s.shape[0] for s in states])
    Z = torch.nn.utils.rnn.pad_sequence([s.float().clone() for s in states], batch_first=True)
    t = torch.arange(Z.shape[1])[None, :]
    mask = (t < lengths[:, None]).to(Z.device)
    position = (t / (lengths[:, None] - 1).clamp(min=1)).to(Z.device, torch.float32)
    return TokenBatch(Z, mask, torch.where(mask, position, 0.0))


def standardised(tokens: TokenBatch, rows: np.ndarray) -> TokenBatch:
    """Token states scaled per dimension by the mean and std of `rows`' real tokens (no labels are read)."""
    index = torch.as_tensor(np.asarray(rows), dtype=torch.long, device=tokens.Z.device)
    real = tokens.Z[index][tokens.mask[index]]
    mean, std = real.mean(dim=0), real.std(dim=0).clamp(min=1e-6)
    return TokenBatch((tokens.Z - mean) / std * tokens.mask[..., None], tokens.mask, tokens.position)


@dataclass(frozen=True)
class OuterFit:
    """One outer fit: its token weights [N, T] for every passage, the grid point and steps inner CV chose, and
    that choice's mean inner validation loss (nan when the rows were too few for inner folds)."""

    weights: torch.Tensor
    params: AggregatorParams
    steps: int
    inner_loss: float


def _row_weights(sets: Sequence[np.ndarray], n: int, device: torch.device) -> torch.Tensor:
    R = torch.zeros(len(sets), n, device=device)
    for m, rows in enumerate(sets):
        R[m, torch.as_tensor(np.asarray(rows), dtype=torch.long)] = 1.0
    return R


def _mean_losses(bank: AggregatorBank, tokens: TokenBatch, y: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """[M] each model's mean logistic loss over its own rows."""
    logits = bank.logits(tokens.Z, tokens.mask, tokens.position)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, y.expand_as(logits), reduction="none")
    return (bce * R).sum(dim=1) / R.sum(dim=1).clamp(min=1)


def train_bank(kind: str, points: Sequence[AggregatorParams], tokens: TokenBatch, y: np.ndarray,
               fit_sets: Sequence[np.ndarray], settings: TrainSettings, seed: int = 0,
               val_sets: Sequence[np.ndarray] | None = None, stop_at: Sequence[int] | None = None
               ) -> tuple[np.ndarray, list[torch.Tensor]]:
    """Train model m (grid point points[m]) on rows fit_sets[m] by full-batch Adam on the logistic loss +
    l2·|readout|². Returns the validation-loss curves [M, checks] (with val_sets) and, with stop_at, each model's
    token weights [N, T] read at its own step stop_at[m] (early stopping's snapshot). Every model starts from the
    parameters one bank of all M seeded with `seed` gives it; models of one head count train together."""
    device = tokens.Z.device
    every = AggregatorBank(kind, tokens.Z.shape[-1], points, seed).to(device)
    used, local = _rows_read(fit_sets, val_sets, len(y))
    train_tokens = _subset(tokens, used)
    target = torch.as_tensor(np.asarray(y)[used], dtype=torch.float32, device=device)[None, :]
    R = _row_weights([local[np.asarray(r, dtype=np.int64)] for r in fit_sets], len(used), device)
    V = _row_weights([local[np.asarray(r, dtype=np.int64)] for r in val_sets], len(used), device) \
        if val_sets is not None else None
    curve: np.ndarray | None = None
    snapshots: list[torch.Tensor | None] = [None] * len(points)
    for models in every.head_groups():
        bank = every.select(models)
        optimiser = torch.optim.Adam(bank.parameters(), lr=settings.lr)
        stops = None if stop_at is None else [stop_at[m] for m in models]
        curves: list[np.ndarray] = []
        mine: list[torch.Tensor | None] = [None] * len(models)
        _run(bank, optimiser, train_tokens, tokens, target, R[models], None if V is None else V[models], settings,
             settings.max_steps if stops is None else max(stops), stops, curves, mine)
        if curves:
            curve = np.full((len(points), len(curves)), np.nan) if curve is None else curve
            curve[models] = np.stack(curves, axis=1)
        for m, snapshot in zip(models, mine, strict=True):
            snapshots[m] = snapshot
    return (np.empty((len(points), 0)) if curve is None else curve), [s for s in snapshots if s is not None]


def _rows_read(fit_sets: Sequence[np.ndarray], val_sets: Sequence[np.ndarray] | None,
               n: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows any model trains or validates on (sorted), and each of the n rows' index among them (-1: none)."""
    sets = [np.asarray(r, dtype=np.int64) for r in [*fit_sets, *(val_sets or [])]]
    used = np.unique(np.concatenate(sets)) if sets else np.arange(0)
    local = np.full(n, -1, dtype=np.int64)
    local[used] = np.arange(used.size)
    return used, local


def _subset(tokens: TokenBatch, rows: np.ndarray) -> TokenBatch:
    """Those rows only, cut to their longest passage. Training never reads another row: each model's loss weighs
    only its own rows (R, V), so leaving out the held-out test passages and the padding beyond the longest train
    passage changes no gradient, only the time (the test split is ~40% of the passages of a default concept)."""
    index = torch.as_tensor(rows, dtype=torch.long, device=tokens.Z.device)
    mask = tokens.mask[index]
    width = max(int(mask.sum(dim=1).max()), 1) if rows.size else 1
    return TokenBatch(tokens.Z[index, :width], mask[:, :width], tokens.position[index, :width])


def _run(bank: AggregatorBank, optimiser: torch.optim.Optimizer, tokens: TokenBatch, every: TokenBatch,
         target: torch.Tensor, R: torch.Tensor, V: torch.Tensor | None, settings: TrainSettings, steps: int,
         stop_at: Sequence[int] | None, curves: list[np.ndarray], snapshots: list[torch.Tensor | None]) -> None:
    """Full-batch training on `tokens` (the rows read); early stopping's snapshots weigh `every` passage."""
    with torch.enable_grad():
        for step in range(1, steps + 1):
            optimiser.zero_grad()
            loss = _mean_losses(bank, tokens, target, R).sum()
            loss = loss + settings.l2 * sum((p ** 2).sum() for p in bank.readout_weights())
            loss.backward()
            optimiser.step()
            if V is not None and step % settings.check_every == 0:
                with torch.no_grad():
                    curves.append(_mean_losses(bank, tokens, target, V).cpu().numpy())
            if stop_at is not None and step in stop_at:
                weights = bank.token_weights(every.Z, every.mask, every.position)
                for m, at in enumerate(stop_at):
                    if at == step:
                        snapshots[m] = weights[m]


def fit_outer(kind: str, grid: Sequence[AggregatorParams], tokens: TokenBatch, y: np.ndarray, groups: np.ndarray,
              outer_sets: Sequence[np.ndarray], settings: TrainSettings, seed: int = 0) -> list[OuterFit]:
    """Nested CV for every outer fit at once: per outer fit, the (grid point, step count) with the lowest mean
    validation loss over inner grouped folds of its own rows, then that point refitted on all its rows for that
    many steps. An outer fit too small for inner folds takes the first grid point and max_steps."""
    y, groups = np.asarray(y), np.asarray(groups)
    jobs: list[tuple[int, int]] = []  # (outer fit, grid point) per inner model
    fits, vals, points = [], [], []
    for k, rows in enumerate(outer_sets):
        yk = y[rows]
        if min(int(yk.sum()), int((1 - yk).sum()), np.unique(groups[rows]).size) < INNER_FOLDS:
            continue
        for fit, val in StratifiedGroupKFold(INNER_FOLDS, shuffle=True, random_state=seed).split(rows, yk,
                                                                                                 groups[rows]):
            for g, point in enumerate(grid):
                jobs.append((k, g))
                fits.append(rows[fit])
                vals.append(rows[val])
                points.append(point)
    chosen = {k: (0, settings.max_steps, float("nan")) for k in range(len(outer_sets))}
    if jobs:
        curve, _ = train_bank(kind, points, tokens, y, fits, settings, seed, val_sets=vals)
        for k in {k for k, _ in jobs}:
            best = None
            for g in range(len(grid)):
                mine = [m for m, job in enumerate(jobs) if job == (k, g)]
                mean_curve = curve[mine].mean(axis=0)
                at = int(np.argmin(mean_curve))
                if best is None or mean_curve[at] < best[2]:
                    best = (g, (at + 1) * settings.check_every, float(mean_curve[at]))
            assert best is not None
            chosen[k] = best
    order = range(len(outer_sets))
    _, weights = train_bank(kind, [grid[chosen[k][0]] for k in order], tokens, y, list(outer_sets), settings,
                               seed, stop_at=[chosen[k][1] for k in order])
    return [OuterFit(weights[k], grid[chosen[k][0]], chosen[k][1], chosen[k][2]) for k in order]


def outer_fit_rows(y: np.ndarray, groups: np.ndarray, train: np.ndarray, n_folds: int = 5,
                   seed: int = 0) -> list[np.ndarray]:
    """Row indices each outer fit trains on: D1's CV folds' training parts over the `train` rows, then all of
    `train` (the fit that pools the held-out test)."""
    train = np.asarray(train)
    splits = StratifiedGroupKFold(n_folds, shuffle=True, random_state=seed).split(
        train, np.asarray(y)[train], np.asarray(groups)[train])
    return [train[fit] for fit, _ in splits] + [train]
