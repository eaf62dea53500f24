"""DiffMean's folds fitted together on the features' device (diffmean_batched) against DiffMeanProbe, the estimator
a CPU cell keeps: every record equal, scores within float64 round-off of the class means and the projection."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_batched_logistic import _cell
from tolerances import WIDTHS

from poolbench.prober import batched_cell
from poolbench.prober.batched_cell import batched_d1_cell
from poolbench.prober.d1 import evaluate_d1
from poolbench.prober.diffmean_batched import diffmean_scores
from poolbench.prober.fast_folds import stratified_group_splits
from poolbench.prober.probes import DiffMeanProbe

EPS64 = float(np.finfo(np.float64).eps)


def _round_off(X: np.ndarray, rows: np.ndarray, model: DiffMeanProbe, scored: np.ndarray) -> np.ndarray:
    """Per scored row: two float64 evaluations of x·dir − thr with the class means summed in other orders differ by
    WIDTHS widths of eps·√terms of the magnitudes involved: the means (len(rows) terms of |x| each, carried through
    the direction into the product) and the product itself (d terms of |x|·|dir|)."""
    d, m = X.shape[1], len(rows)
    mean_err = WIDTHS * EPS64 * math.sqrt(m) * np.abs(X[rows]).max()  # per entry of either class mean
    dir_abs = np.abs(model.direction_)
    product = np.abs(scored) @ dir_abs + abs(model.threshold_)
    through_means = (np.abs(scored) + np.abs(X[rows]).max()).sum(axis=1) * 2 * mean_err
    return WIDTHS * EPS64 * math.sqrt(d + 1) * product + through_means


def test_every_fold_scores_as_diffmeanprobe_does_and_equal_rows_tie():
    X, y, g, Xt, _, _, _ = _cell()
    X[10], X[40] = X[3], X[3]  # equal rows (P2_first's shared first token): one score, bit for bit
    splits = stratified_group_splits(y, g, 5, 0)
    rows = [fit for fit, _ in splits] + [np.arange(y.size)]
    train, test = diffmean_scores(torch.as_tensor(X), rows, y, torch.as_tensor(Xt))
    assert train.shape == (6, y.size) and test.shape == (6, len(Xt))
    for f, r in enumerate(rows):
        model = DiffMeanProbe().fit(X[r], y[r])
        for mine, scored in ((train[f].numpy(), X), (test[f].numpy(), Xt)):
            gap = np.abs(mine - model.decision_function(scored))
            assert (gap <= _round_off(X, r, model, scored)).all(), (f, gap.max())
        assert train[f, 10] == train[f, 3] == train[f, 40]


def test_a_wrong_class_mean_is_far_outside_the_bound():
    """The bound is not vacuous: a fold's direction from the wrong rows (one row dropped) moves the scores past it."""
    X, y, _, _, _, _, _ = _cell()
    r = np.arange(y.size)
    model = DiffMeanProbe().fit(X, y)
    wrong = diffmean_scores(torch.as_tensor(X), [r[1:]], y, torch.as_tensor(X[:2]))[0][0].numpy()
    gap = np.abs(wrong - model.decision_function(X))
    assert (gap > _round_off(X, r, model, X)).mean() > 0.9


def test_a_cell_through_the_device_branch_keeps_every_diffmean_record(monkeypatch):
    """The GPU's branch run on this CPU: DiffMean's records (CV and held-out AUROCs, CI, folds, predictions) equal
    the estimator's, as the CUDA twin test checks on a GPU."""
    X, y, g, Xt, yt, gt, types = _cell()
    ref = evaluate_d1(X, y, g, Xt, yt, gt, n_bootstrap=50)["diffmean"]
    monkeypatch.setattr(batched_cell, "DIFFMEAN_ON_DEVICE", ("cpu", "cuda"))
    monkeypatch.setattr(batched_cell, "evaluate_d1", lambda *a, **k: pytest.fail("the estimator path ran"))
    result, _ = batched_d1_cell(X, y, g, Xt, yt, gt, n_bootstrap=50, types_train=types, reliability=False)
    new = result["diffmean"]
    assert new.to_record() == ref.to_record()
    np.testing.assert_array_equal(new.oof_folds, ref.oof_folds)
    np.testing.assert_array_equal(new.test_pred, ref.test_pred)
    model = DiffMeanProbe().fit(X, y)
    assert (np.abs(new.test_scores - ref.test_scores) <= _round_off(X, np.arange(y.size), model, Xt)).all()


def test_a_gpu_cell_keeps_its_host_to_the_one_core_its_task_holds():
    """On a GPU the cell's host work runs on one thread (torch's and the BLAS/OpenMP pools), restored after; a CPU
    cell keeps its CPU_THREADS torch threads and the pools as they are. Needs no GPU: only the device's type is read."""
    from threadpoolctl import threadpool_info

    before = torch.get_num_threads()
    with batched_cell._host_threads(torch.device("cuda"), batched_cell.CPU_THREADS):
        assert torch.get_num_threads() == 1
        assert all(pool["num_threads"] == 1 for pool in threadpool_info())
    assert torch.get_num_threads() == before
    pools = {pool["filepath"]: pool["num_threads"] for pool in threadpool_info()}
    with batched_cell._host_threads(torch.device("cpu"), None):  # no thread count given: nothing set
        assert {pool["filepath"]: pool["num_threads"] for pool in threadpool_info()} == pools
    with batched_cell._host_threads(torch.device("cpu"), 2):  # torch's own threads only (its OpenMP pool with them)
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == before
