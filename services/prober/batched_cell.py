"""One unsupervised cell's D1 logistic probe and its reliability statistics from batched fits (batched_logistic).

The same fits as evaluate_d1 + cell_reliability (the same folds, labels, rows and stopping rule), gathered into a
handful of fit_many calls: the all-train fit (exact Newton on the shared Gram), every fold of D1 and the seed spread
warm-started from it, the control task's folds, and one call per MDL block. The statistics are assembled with the
very functions the per-fit path uses (auroc, auroc_ci, platt_scaling, the MDL block rules), so only the fits move.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from scipy.special import expit
from threadpoolctl import threadpool_limits

from poolbench.prober.auroc import ProbeError, auroc, auroc_ci
from poolbench.prober.batched_logistic import fit_many, shared_gram
from poolbench.prober.d1 import D1Result, ProbeResult, check_split, evaluate_d1
from poolbench.prober.diffmean_batched import diffmean_scores
from poolbench.prober.fast_folds import check_folds, stratified_group_splits
from poolbench.prober.mdl import (
    MDL_CALIBRATION_FOLDS,
    MDL_FRACTIONS,
    MDL_MIN_BLOCK,
    MDL_MIN_BLOCKS,
    OnlineCode,
    _label_bits,
    block_plan,
    platt_scaling,
)
from poolbench.prober.probes import PROBE_NAMES
from poolbench.prober.reliability import reliability_stats
from poolbench.prober.seed_spread import SeedSpread
from poolbench.prober.selectivity import Selectivity, control_labels, control_na_reason

Splits = list[tuple[np.ndarray, np.ndarray]]


CPU_THREADS = 1  # torch threads of one cell on a CPU: the driver runs one task per core (bench/README, D1 cost)
# Devices whose cells fit DiffMean's folds batched beside the logistic ones (diffmean_batched): a GPU, where the host
# estimator was ~28% of a cell; a CPU keeps the estimator (the same arithmetic on the same host, and make run's
# records to the last bit).
DIFFMEAN_ON_DEVICE = ("cuda",)
# Cells probed in one batched call (batched_d1_cells) on a GPU: a layer's 19 card strategies at once. At n = 1,400,
# d = 4,096 that is ~7 GB of float64 at its peak, counted from the shapes (not measured): the cells' train and test
# rows 1.2, the centred copy 0.9, the Grams 0.3, and a fold slice's dual matrices, factors and the matrix being
# factored, 4 x 0.95 (batched_logistic's CUDA slice). On a CPU one: the arithmetic is the same, the host's dispatch
# is no cost beside it, and each cell keeps make run's records to the last bit.
CELLS_PER_CALL_CUDA = 19


def cells_per_call(device: torch.device) -> int:
    """How many cells of one layer batched_d1_cells takes at once on `device`."""
    return 1 if device.type == "cpu" else CELLS_PER_CALL_CUDA


@contextmanager
def _host_threads(device: torch.device, threads: int | None) -> Iterator[None]:
    """The cell's host threads, restored after. On a CPU torch's intra-op threads are `threads` (when given). On a
    GPU the host only dispatches and does numpy's share, on the one core the task holds: torch's threads and the
    BLAS/OpenMP pools are 1. Why: on an H100 (bench/measured/h100_session20/) one layer's cells in one process
    took 45.5 CPU-s in 10.1 s with the pools at their defaults, and 8 or 16 such processes kept 13-16 of the 16
    cores busy at 3.6 cells/s, no faster than 4 (3.3). Ray gives a task OMP_NUM_THREADS, which a pool started
    before it was set does not read; this limit holds whoever started the pools."""
    before = torch.get_num_threads()
    if device.type == "cpu":
        if threads:
            torch.set_num_threads(threads)
        pools = contextlib.nullcontext()
    else:
        torch.set_num_threads(1)
        pools = threadpool_limits(limits=1)
    try:
        with pools:
            yield
    finally:
        torch.set_num_threads(before)


@functools.cache
def probe_device() -> torch.device:
    """The probes' device: the GPU when one is present, else the CPU (float64 either way). Asked once a process:
    torch.cuda.is_available() took 10 ms a cell on an H100 (its device count, 2% of a cell's host time)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _fold_scores(first: int, splits: Splits, scores: np.ndarray,
                 y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(per-fold AUROC, out-of-fold scores, fold of each row) of fits first .. first+K−1 on `splits`."""
    oof, folds = np.empty(y.size), np.full(y.size, -1, dtype=np.int64)
    values = np.empty(len(splits))
    for k, (_, val) in enumerate(splits):
        oof[val] = scores[first + k, val]
        folds[val] = k
        values[k] = auroc(oof[val], y[val])
    return values, oof, folds


def _probe_result(name: str, splits: Splits, scores: np.ndarray, y: np.ndarray, test_scores: np.ndarray,
                  y_test: np.ndarray, groups_test: np.ndarray, n_bootstrap: int, ci_level: float) -> ProbeResult:
    """evaluate_d1's ProbeResult from the fold fits' scores [folds, n] and the all-train fit's test scores."""
    fold_aurocs, oof, oof_folds = _fold_scores(0, splits, scores, y)
    ci = auroc_ci(test_scores, y_test, groups_test, ci_level)
    return ProbeResult(
        probe=name, cv_auroc=float(fold_aurocs.mean()), cv_fold_aurocs=fold_aurocs,
        test_auroc=auroc(test_scores, y_test), ci_low=ci.low, ci_high=ci.high, n_train=int(y.size),
        n_test=int(y_test.size), n_folds=len(splits), n_bootstrap=n_bootstrap, ci_level=ci_level,
        oof_scores=oof, test_scores=test_scores, test_pred=(test_scores > 0).astype(np.int64),
        ci_method=ci.method, ci_degenerate=ci.degenerate, oof_folds=oof_folds)


def _check_two_classes(y: np.ndarray, splits: Splits, what: str) -> None:
    for k, (fit, val) in enumerate(splits):
        if np.unique(y[val]).size < 2 or np.unique(y[fit]).size < 2:
            raise ProbeError(f"{what} {k} holds one class only" + ("; the pair groups are too lopsided"
                                                                   if what == "CV fold" else ""))


def batched_d1_cell(X_train: np.ndarray, y_train: np.ndarray, groups_train: np.ndarray, X_test: np.ndarray,
                    y_test: np.ndarray, groups_test: np.ndarray, *, n_folds: int = 5, seed: int = 0,
                    n_bootstrap: int = 1000, reliability: bool = True, types_train: np.ndarray | None = None,
                    n_seeds: int = 5, device: torch.device | None = None,
                    ci_level: float = 0.95) -> tuple[D1Result, dict]:
    """evaluate_d1(...) and cell_reliability(...) of one cell (records equal within the solver's stopping rule)."""
    return batched_d1_cells([X_train], y_train, groups_train, [X_test], y_test, groups_test, n_folds=n_folds,
                            seed=seed, n_bootstrap=n_bootstrap, reliability=reliability, types_train=types_train,
                            n_seeds=n_seeds, device=device, ci_level=ci_level)[0]


def batched_d1_cells(X_trains: Sequence[np.ndarray], y_train: np.ndarray, groups_train: np.ndarray,
                     X_tests: Sequence[np.ndarray], y_test: np.ndarray, groups_test: np.ndarray, *,
                     n_folds: int = 5, seed: int = 0, n_bootstrap: int = 1000, reliability: bool = True,
                     types_train: np.ndarray | None = None, n_seeds: int = 5, device: torch.device | None = None,
                     ci_level: float = 0.95) -> list[tuple[D1Result, dict]]:
    """batched_d1_cell of B cells that share their passages (labels, pairs, types: a layer's strategies), features
    of one width: every fit call of the B cells is one (batched_logistic's cells), so a layer's cells run one
    Newton loop each for D1's folds, the control task and each MDL block. Each cell's records are those it gets
    alone, up to the GEMMs' rounding (within the stopping rule's bound)."""
    device = device or probe_device()
    with _host_threads(device, CPU_THREADS):
        return _batched_d1_cells(X_trains, y_train, groups_train, X_tests, y_test, groups_test, n_folds=n_folds,
                                 seed=seed, n_bootstrap=n_bootstrap, reliability=reliability,
                                 types_train=types_train, n_seeds=n_seeds, device=device, ci_level=ci_level)


def _stacked(matrices: Sequence[np.ndarray], device: torch.device) -> torch.Tensor:
    """[B, rows, d] float64 on `device`: one cell's float64 matrix on a CPU is a view of it, no copy; otherwise each
    matrix travels in its own dtype (a table's float32: half the bytes) into its slot of one float64 tensor, widened
    where it lands. Where a host float64 copy of each matrix, a host stack of them and one transfer of the stack took
    most of a GPU layer task's seconds (bench/measured/h100_session30: 2.1 of 4.0 s a layer). The same numbers: a
    float32 value widens to one float64 wherever it is widened."""
    first = matrices[0]
    if len(matrices) == 1 and device.type == "cpu" and first.dtype == np.float64:
        return torch.as_tensor(first[None])
    out = torch.empty((len(matrices), *first.shape), dtype=torch.float64, device=device)
    for slot, matrix in zip(out, matrices, strict=True):
        slot.copy_(torch.from_numpy(np.ascontiguousarray(matrix)).to(device))
    return out


def _batched_d1_cells(X_trains: Sequence[np.ndarray], y_train: np.ndarray, groups_train: np.ndarray,
                      X_tests: Sequence[np.ndarray], y_test: np.ndarray, groups_test: np.ndarray, *, n_folds: int,
                      seed: int, n_bootstrap: int, reliability: bool, types_train: np.ndarray | None, n_seeds: int,
                      device: torch.device, ci_level: float) -> list[tuple[D1Result, dict]]:
    wide = device.type == "cpu" and len(X_trains) == 1  # one CPU cell: its float64 rows, a view; else _stacked widens
    trains = [check_split("train", X, y_train, groups_train, float64=wide) for X in X_trains]
    tests = [check_split("test", X, y_test, groups_test, float64=wide) for X in X_tests]
    (_, y_train, groups_train), (_, y_test, groups_test) = trains[0], tests[0]
    X_trains, X_tests = [t[0] for t in trains], [t[0] for t in tests]
    widths = {X.shape[1] for X in (*X_trains, *X_tests)}
    if len(widths) != 1:
        raise ProbeError(f"train has {X_trains[0].shape[1]} features but test has {X_tests[0].shape[1]}"
                         if len(X_trains) == 1 else f"cells batched together differ in width: {sorted(widths)}")
    check_folds(y_train, groups_train, n_folds)
    X = _stacked(X_trains, device)
    splits = stratified_group_splits(y_train, groups_train, n_folds, seed)
    _check_two_classes(y_train, splits, "CV fold")
    seed_splits = [stratified_group_splits(y_train, groups_train, n_folds, seed + k)
                   for k in range(1, n_seeds)] if reliability else []
    for s in seed_splits:
        _check_two_classes(y_train, s, "CV fold")
    gram = shared_gram(X)
    every = np.arange(y_train.size)
    full = fit_many(X, [every], [y_train], gram=gram)
    fold_rows = [fit for s in [splits, *seed_splits] for fit, _ in s]
    folds = fit_many(X, fold_rows, [y_train[r] for r in fold_rows], gram=gram, init=full)
    scores = folds.scores(X).cpu().numpy()  # [B, folds, n]
    X_test = _stacked(X_tests, device)
    test_scores = full.scores(X_test)[:, 0].cpu().numpy()
    results = []
    for b in range(len(X_trains)):
        found = {"logistic": _probe_result("logistic", splits, scores[b], y_train, test_scores[b], y_test,
                                           groups_test, n_bootstrap, ci_level)}
        if device.type in DIFFMEAN_ON_DEVICE:  # the DiffMean folds as two GEMMs where the features are
            dm_train, dm_test = diffmean_scores(X[b], [fit for fit, _ in splits] + [every], y_train, X_test[b])
            found["diffmean"] = _probe_result("diffmean", splits, dm_train.cpu().numpy(), y_train,
                                              dm_test[-1].cpu().numpy(), y_test, groups_test, n_bootstrap, ci_level)
        else:  # on a CPU the estimator itself, as make run's records were computed
            found.update(evaluate_d1(X_trains[b], y_train, groups_train, X_tests[b], y_test, groups_test,
                                     n_folds=n_folds, seed=seed, n_bootstrap=n_bootstrap, probes=("diffmean",),
                                     ci_level=ci_level).probes)
        results.append(D1Result(probes={name: found[name] for name in PROBE_NAMES}, seed=seed))
    if not reliability:
        return [(result, {}) for result in results]
    spreads = []
    for b, result in enumerate(results):
        values = [result.probes["logistic"].cv_auroc] + [
            float(_fold_scores(n_folds * (1 + i), s, scores[b], y_train)[0].mean())
            for i, s in enumerate(seed_splits)]
        spreads.append(SeedSpread(seeds=tuple(seed + k for k in range(n_seeds)), cv_aurocs=np.array(values),
                                  mean=float(np.mean(values)), std=float(np.std(values, ddof=1))))
    sels = _selectivity(X, y_train, groups_train, types_train, [sp.cv_aurocs[0] for sp in spreads], seed, n_folds,
                        gram, ci_level)
    codes = _online_code(X, y_train, groups_train, seed)
    return [(result, reliability_stats(spread, sel, code))
            for result, spread, sel, code in zip(results, spreads, sels, codes, strict=True)]


def _selectivity(X: torch.Tensor, y: np.ndarray, groups: np.ndarray, types: np.ndarray | None,
                 true_scores: Sequence[float], seed: int, n_folds: int, gram: tuple[torch.Tensor, torch.Tensor],
                 ci_level: float) -> list[Selectivity]:
    """selectivity.selectivity of D1's probe for each of X's cells [B, n, d], the control folds of all of them
    fitted in one batch."""
    if types is not None and np.asarray(types).shape != y.shape:
        raise ProbeError(f"selectivity: types {np.asarray(types).shape} and labels {y.shape} differ")
    reason = control_na_reason(types, groups, n_folds, seed)
    if reason is not None:
        return [Selectivity(true_score=float(true), control_score=None, selectivity=None, na_reason=reason)
                for true in true_scores]
    control = control_labels(np.asarray(types), seed)
    splits = stratified_group_splits(control, groups, n_folds, seed)
    _check_two_classes(control, splits, "control CV fold")
    fit = fit_many(X, [f for f, _ in splits], [control[f] for f, _ in splits], gram=gram)
    all_scores = fit.scores(X).cpu().numpy()
    out_list = []
    for scores, true in zip(all_scores, true_scores, strict=True):
        out, per_fold = np.empty(y.size), []
        for k, (_, val) in enumerate(splits):
            s = scores[k, val]
            per_fold.append(auroc(s, control[val]))
            out[val] = (s - s.mean()) / (s.std() or 1.0)
        control_score = float(np.mean(per_fold))
        ci = auroc_ci(out, control, groups, ci_level)
        out_list.append(Selectivity(true_score=float(true), control_score=control_score,
                                    selectivity=float(true) - control_score, control_ci_low=ci.low,
                                    control_ci_high=ci.high))
    return out_list


def _online_code(X: torch.Tensor, y: np.ndarray, groups: np.ndarray, seed: int) -> list[OnlineCode]:
    """mdl.online_codelength at its defaults (D1's probe, calibrated blocks) of each of X's cells [B, n, d], each
    block's fold fits of all of them in one batch."""
    plan = block_plan(y, groups, seed, True, MDL_FRACTIONS, MDL_MIN_BLOCK, MDL_MIN_BLOCKS)
    if plan.unplanned is not None:
        return [plan.unplanned] * X.shape[0]
    order, ends = plan.order, plan.ends
    y_o, g_o = y[order], groups[order]
    bits = [[float(ends[0])] for _ in range(X.shape[0])]
    folds = MDL_CALIBRATION_FOLDS
    for start, end in itertools.pairwise(ends):
        blocks: list[float | None] = [None] * X.shape[0]
        y_prefix, g_prefix = y_o[:start], g_o[:start]
        n_pos = int(y_prefix.sum())
        if (np.unique(y_prefix).size == 2 and min(n_pos, start - n_pos) >= folds
                and np.unique(g_prefix).size >= folds):
            splits = stratified_group_splits(y_prefix, g_prefix, folds, seed)
            if all(np.unique(y_prefix[fit]).size == 2 for fit, _ in splits):
                # this block's universe: what is sent so far, in each cell
                sent = X.index_select(1, torch.as_tensor(order[:end], device=X.device))
                fit = fit_many(sent, [f for f, _ in splits], [y_prefix[f] for f, _ in splits], exact=True)
                for b, scores in enumerate(fit.scores(sent).cpu().numpy()):
                    oof = np.empty(start)
                    for k, (_, val) in enumerate(splits):
                        oof[val] = scores[k, val]
                    a, c = platt_scaling(oof, y_prefix)
                    blocks[b] = _label_bits(np.mean(expit(a * scores[:, start:end] + c), axis=0), y_o[start:end])
        for cell_bits, block in zip(bits, blocks, strict=True):
            cell_bits.append(float(end - start) if block is None else block)
    codes = []
    for cell_bits in bits:
        online = float(sum(cell_bits))
        codes.append(OnlineCode(uniform_bits=float(y.size), online_bits=online, compression=y.size / online,
                                block_ends=tuple(ends), block_bits=tuple(cell_bits)))
    return codes
