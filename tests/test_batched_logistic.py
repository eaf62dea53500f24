"""The batched logistic solver and the batched D1 cell against today's one-fit-at-a-time path and scikit-learn.

Tolerances from the stopping rule: a fit stopped at |∇F|∞ < tol lies within √(d+1)·tol / λ_min(H) of the optimum
(F is λ_min-strongly convex near it; H at the optimum, where two stopped fits both lie). Two such fits differ by
twice that, and a passage's score (x̃, 1)·θ by at most ‖(x̃, 1)‖₂ times it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.special import expit
from sklearn.linear_model import LogisticRegression

from poolbench.prober import batched_logistic
from poolbench.prober.batched_cell import batched_d1_cell
from poolbench.prober.batched_logistic import fit_many, shared_gram
from poolbench.prober.d1 import evaluate_d1
from poolbench.prober.lapack_factors import factor_in_place
from poolbench.prober.newton_logistic import NewtonLogisticProbe
from poolbench.prober.reliability import cell_reliability

TOL = 1e-6


def _data(n: int, d: int, seed: int, shift: float = 0.6) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Matched pairs (pos, neg), anisotropic features with offsets, a concept direction on the first features."""
    rng = np.random.default_rng(seed)
    y = np.tile([1, 0], n // 2)
    X = rng.normal(size=(n, d)) * rng.uniform(0.3, 3.0, size=d) + rng.normal(size=d) * 2
    X[y == 1, :8] += shift
    return X, y, np.repeat(np.arange(n // 2), 2)


def _bound(model: NewtonLogisticProbe, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per row of X: the largest score gap two fits stopped at |∇F|∞ < TOL can show (module docstring)."""
    Z = (X - model.mean_) / model.scale_
    p = expit(Z @ model.coef_ + model.intercept_)
    A = np.c_[Z, np.ones(len(Z))]
    H = A.T @ (A * (p * (1 - p))[:, None])
    H[:-1, :-1] += np.eye(Z.shape[1])
    radius = 2 * math.sqrt(Z.shape[1] + 1) * TOL / np.linalg.eigvalsh(H)[0]
    return radius * np.linalg.norm(A, axis=1)


def _evaluation_gap(ref: NewtonLogisticProbe, fit, f: int, X: np.ndarray) -> np.ndarray:
    """Per row of X: the largest gap between ref's score ((x − mean)/scale)·coef + b and the batch's (x − μ₀)·v + c
    for the same coefficients (v = coef/scale, c = b + (μ₀ − mean)·v): float64 round-off of d + 2 terms each,
    WIDTHS widths of eps64 times the terms' magnitude (tests/tolerances.py's rule at float64's eps)."""
    from tolerances import WIDTHS

    center, v, c = fit.center.numpy(), fit.v[f].numpy(), float(fit.c[f])
    terms = (np.abs((X - ref.mean_) / ref.scale_) @ np.abs(ref.coef_) + abs(ref.intercept_)
             + np.abs(X - center) @ np.abs(v) + abs(c) + np.abs(center - ref.mean_) @ np.abs(v))
    return WIDTHS * np.finfo(np.float64).eps * terms * np.sqrt(X.shape[1] + 2)


@pytest.mark.numerics
def test_fit_many_equals_each_fit_l2_logistic_on_its_own_rows():
    X, y, _ = _data(80, 120, 0)
    rng = np.random.default_rng(1)
    rows = [np.arange(80)] + [np.sort(rng.choice(80, 64, replace=False)) for _ in range(4)] + [np.arange(30)]
    Xt = torch.as_tensor(X)
    shared = fit_many(Xt, rows, [y[r] for r in rows])
    exact = fit_many(Xt, rows, [y[r] for r in rows], exact=True)
    for f, r in enumerate(rows):
        ref = NewtonLogisticProbe().fit(X[r], y[r])
        bound = _bound(ref, X, y)
        # a float64 mean of len(r) rows, two summation orders: k widths of eps64 x the values' magnitude x sqrt(n)
        mean_tol = 4 * np.finfo(np.float64).eps * float(np.abs(X[r]).max()) * np.sqrt(len(r))
        np.testing.assert_allclose(shared.mean[f].numpy(), ref.mean_, rtol=0, atol=mean_tol)
        np.testing.assert_allclose(shared.scale[f].numpy(), ref.scale_, rtol=1e-10)
        for fit in (shared, exact):
            gap = np.abs(fit.scores(Xt)[f].numpy() - ref.decision_function(X))
            assert (gap <= bound).all(), (f, gap.max(), bound.min())


@pytest.mark.numerics
def test_fit_many_matches_scikit_learn_at_a_tight_tolerance():
    X, y, _ = _data(60, 90, 2)
    Z = (X - X.mean(0)) / X.std(0)
    sk = LogisticRegression(C=1.0, tol=1e-12, max_iter=100_000).fit(Z, y)
    fit = fit_many(torch.as_tensor(X), [np.arange(60)], [y])
    ref = NewtonLogisticProbe().fit(X, y)
    # scikit-learn's lbfgs stops at a projected gradient of 1e-12 (its own bound is negligible beside ours)
    gap = np.abs(fit.scores(torch.as_tensor(X))[0].numpy() - sk.decision_function(Z))
    assert (gap <= _bound(ref, X, y)).all()


@pytest.mark.numerics
def test_warm_started_folds_reach_the_same_optimum_with_fewer_factorizations_than_steps():
    X, y, _ = _data(120, 200, 3)
    Xt = torch.as_tensor(X)
    gram = shared_gram(Xt)
    full = fit_many(Xt, [np.arange(120)], [y], gram=gram)
    rows = [np.setdiff1d(np.arange(120), np.arange(k, 120, 5)) for k in range(5)]
    warm = fit_many(Xt, rows, [y[r] for r in rows], gram=gram, init=full)
    for f, r in enumerate(rows):
        ref = NewtonLogisticProbe().fit(X[r], y[r])
        assert (np.abs(warm.scores(Xt)[f].numpy() - ref.decision_function(X)) <= _bound(ref, X, y)).all()
    assert (warm.factorizations <= warm.iterations).all()


def _cell(n: int = 120, d: int = 150, seed: int = 4):
    X, y, g = _data(n, d, seed)
    Xt, yt, gt = _data(n // 2, d, seed + 100)
    types = np.array(["a", "b", "c", "d"])[g % 4]
    return X, y, g, Xt, yt, gt + 10_000, types


@pytest.mark.numerics
def test_batched_cell_records_equal_todays_evaluate_d1_and_cell_reliability():
    X, y, g, Xt, yt, gt, types = _cell()
    result, stats = batched_d1_cell(X, y, g, Xt, yt, gt, n_bootstrap=50, types_train=types)
    old = evaluate_d1(X, y, g, Xt, yt, gt, n_bootstrap=50)
    old_stats = cell_reliability(X, y, g, np.arange(y.size), Xt, yt, gt, seed=0, types_train=types,
                                 d1_cv_auroc=old["logistic"].cv_auroc)
    assert list(result.probes) == list(old.probes)
    for name in old.probes:
        new, ref = result[name], old[name]
        assert new.to_record() == ref.to_record(), name  # AUROCs, CI: no two scores tie within the bound here
        np.testing.assert_array_equal(new.oof_folds, ref.oof_folds)
        np.testing.assert_array_equal(new.test_pred, ref.test_pred)
    ref_model, ref_folds = NewtonLogisticProbe().fit(X, y), old["logistic"].oof_folds
    assert (np.abs(result["logistic"].test_scores - old["logistic"].test_scores)
            <= _bound(ref_model, Xt, yt)).all()
    for k in range(5):  # out-of-fold scores: each fold's fit within its own bound
        fit, val = np.flatnonzero(ref_folds != k), np.flatnonzero(ref_folds == k)
        gap = np.abs(result["logistic"].oof_scores[val] - old["logistic"].oof_scores[val])
        assert (gap <= _bound(NewtonLogisticProbe().fit(X[fit], y[fit]), X[val], y[val])).all()
    assert stats.keys() == old_stats.keys()
    for key in ("seed_cv_aurocs", "seed_mean", "seed_std", "selectivity", "control_cv_auroc", "control_ci_low",
                "control_ci_high", "mdl_block_ends", "mdl_uniform_bits", "selectivity_na_reason", "mdl_na_reason"):
        assert stats[key] == pytest.approx(old_stats[key], abs=1e-12), key
    # bits are -log2 σ(a·z + b) summed over a block: they move by ≤ n·|a|·Δz/ln 2 with Δz ≤ the score bound
    # (~1e-8 here) and Platt's slope |a| < 10, so 1e-5 bits over the whole code
    np.testing.assert_allclose(stats["mdl_block_bits"], old_stats["mdl_block_bits"], atol=1e-5)
    assert stats["mdl_compression"] == pytest.approx(old_stats["mdl_compression"], abs=1e-7)


def test_batched_cell_fits_in_a_few_solver_calls_and_never_fits_one_probe_at_a_time(monkeypatch):
    X, y, g, Xt, yt, gt, types = _cell()

    def refuse(*_args, **_kwargs):
        raise AssertionError("a logistic probe was fitted one at a time")

    monkeypatch.setattr(NewtonLogisticProbe, "fit", refuse)
    monkeypatch.setitem(batched_logistic.FIT_COUNTER, "calls", 0)
    monkeypatch.setitem(batched_logistic.FIT_COUNTER, "fits", 0)
    _, stats = batched_d1_cell(X, y, g, Xt, yt, gt, n_bootstrap=20, types_train=types)
    blocks = len(stats["mdl_block_ends"]) - 1
    # all-train, D1 + seed folds, control folds, one call per MDL block; 1 + 25 + 5 + 3 per block fits
    assert batched_logistic.FIT_COUNTER["calls"] == 3 + blocks
    assert batched_logistic.FIT_COUNTER["fits"] == 1 + 25 + 5 + 3 * blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_cell_on_cuda_equals_its_cpu_twin():
    X, y, g, Xt, yt, gt, types = _cell()
    cpu, cpu_stats = batched_d1_cell(X, y, g, Xt, yt, gt, n_bootstrap=20, types_train=types,
                                     device=torch.device("cpu"))
    gpu, gpu_stats = batched_d1_cell(X, y, g, Xt, yt, gt, n_bootstrap=20, types_train=types,
                                     device=torch.device("cuda"))
    assert gpu["logistic"].to_record() == cpu["logistic"].to_record()
    assert gpu["diffmean"].to_record() == cpu["diffmean"].to_record()  # diffmean_batched's GEMMs against the estimator
    np.testing.assert_array_equal(gpu["diffmean"].oof_folds, cpu["diffmean"].oof_folds)
    np.testing.assert_allclose(gpu["diffmean"].test_scores, cpu["diffmean"].test_scores, rtol=0,
                               atol=1e-9 * np.abs(cpu["diffmean"].test_scores).max())
    bound = _bound(NewtonLogisticProbe().fit(X, y), Xt, yt)
    assert (np.abs(gpu["logistic"].test_scores - cpu["logistic"].test_scores) <= bound).all()
    assert gpu_stats["seed_cv_aurocs"] == cpu_stats["seed_cv_aurocs"]
    np.testing.assert_allclose(gpu_stats["mdl_block_bits"], cpu_stats["mdl_block_bits"], atol=1e-5)


def test_s3_head_ranking_builds_its_splitter_once_and_keeps_each_heads_auroc(monkeypatch):
    from sklearn.model_selection import StratifiedGroupKFold

    from poolbench.prober import supervised

    rng = np.random.default_rng(5)
    y, groups = np.tile([1, 0], 30), np.repeat(np.arange(30), 2)
    features = rng.normal(size=(60, 6, 4))
    features[y == 1, 2, 0] += 2.0  # head 2 carries the concept
    expected = []
    for h in range(6):  # the per-head reference: one splitter per head, as before
        folds = StratifiedGroupKFold(3, shuffle=True, random_state=0).split(features[:, h], y, groups)
        expected.append(np.mean([supervised.auroc(NewtonLogisticProbe().fit(features[fit, h], y[fit])
                                                  .decision_function(features[val, h]), y[val])
                                 for fit, val in folds]))
    built = []

    class Counting(StratifiedGroupKFold):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(supervised, "StratifiedGroupKFold", Counting)
    np.testing.assert_array_equal(supervised.head_aurocs(features, y, groups, seed=0), expected)
    assert len(built) == 1 and int(np.argmax(expected)) == 2


def test_probe_pooled_cells_fits_unsupervised_cells_through_the_batched_solver(monkeypatch):
    from poolbench.corpus.passage import Passage
    from poolbench.pooler.pooled_table import PooledTableBuilder
    from poolbench.prober.concept_probe import probe_pooled_cells

    items = [Passage(f"{split}-{i}-{label}", "t", label, f"d{i % 3}", 4, f"{split}-{i}", split, "c")
             for split, n in (("train", 30), ("test", 10)) for i in range(n) for label in (1, 0)]
    rng = np.random.default_rng(6)
    vectors = rng.normal(size=(1, 1, len(items), 12))
    vectors[0, 0, :, 0] += 1.5 * np.array([p.label for p in items])
    builder = PooledTableBuilder(items, 12)
    builder.add(vectors, [2], ["A1_mean"], [p.id for p in items], np.zeros((1, len(items)), bool))
    table, types = builder.table(), {p.id: p.domain for p in items}
    before = probe_pooled_cells(table, "c", n_folds=3, n_bootstrap=20, types=types, batched=False)[0]

    def refuse(*_args, **_kwargs):
        raise AssertionError("a logistic probe was fitted one at a time")

    monkeypatch.setattr(NewtonLogisticProbe, "fit", refuse)
    records, scores = probe_pooled_cells(table, "c", n_folds=3, n_bootstrap=20, types=types)
    assert [r.test_auroc for r in records] == [r.test_auroc for r in before]
    assert [r.cv_auroc for r in records] == [r.cv_auroc for r in before]
    assert records[0].seed_cv_aurocs == before[0].seed_cv_aurocs
    assert scores.num_rows == 2 * 80  # 2 probes × (60 train + 20 test passages)


def test_a_fit_stopped_at_max_iter_is_flagged_and_warned_and_one_that_met_the_rule_is_not(monkeypatch):
    import warnings as warnings_module

    from poolbench.prober.newton_logistic import UnconvergedFitWarning, fit_l2_logistic

    X, y, _ = _data(80, 120, 0)
    rows = [np.arange(80), np.arange(0, 80, 2) + np.tile([0, 1], 20)]
    Xt = torch.as_tensor(X)
    with warnings_module.catch_warnings():
        warnings_module.simplefilter("error", UnconvergedFitWarning)  # none may come from a fit that converges
        done = fit_many(Xt, rows, [y[r] for r in rows])
    assert bool(done.converged.all()) and int(done.iterations.max()) >= 2
    # exactly the steps it needs: the loop ends by exhaustion, the last step's gradient is checked, nothing flagged
    needed = int(done.iterations.max())
    before = batched_logistic.FIT_COUNTER["refits"]
    with warnings_module.catch_warnings():
        warnings_module.simplefilter("error", UnconvergedFitWarning)
        just = fit_many(Xt, rows, [y[r] for r in rows], max_iter=needed)
    assert bool(just.converged.all()) and batched_logistic.FIT_COUNTER["refits"] == before
    torch.testing.assert_close(just.coef, done.coef, rtol=0, atol=0)
    # one step short: the batch leaves both fits short of the rule, the per-fit path fits them again and they are
    # its fits (NewtonLogisticProbe's scores, within the two stopping rules' bound), converged, with no warning
    with warnings_module.catch_warnings():
        warnings_module.simplefilter("error", UnconvergedFitWarning)
        rescued = fit_many(Xt, rows, [y[r] for r in rows], max_iter=1)
    assert bool(rescued.converged.all()) and batched_logistic.FIT_COUNTER["refits"] == before + 2
    for f, r in enumerate(rows):
        ref = NewtonLogisticProbe().fit(X[r], y[r])
        gap = np.abs(rescued.scores(Xt)[f].numpy() - ref.decision_function(X))
        assert np.all(gap <= _evaluation_gap(ref, rescued, f, X))  # the same coefficients, evaluated two ways
    # where the per-fit path cannot either, the fits come back flagged and the call says so
    monkeypatch.setattr(batched_logistic, "REFIT_MAX_ITER", 1)
    with pytest.warns(UnconvergedFitWarning, match=r"2 of 2 logistic fits stopped at max_iter=1 .* and again one at"):
        short = fit_many(Xt, rows, [y[r] for r in rows], max_iter=1)
    assert not bool(short.converged.any())
    # the per-fit solver says the same of its own fit
    Z = (X - X.mean(0)) / X.std(0)
    with pytest.warns(UnconvergedFitWarning, match=r"1 of 1 logistic fits stopped at max_iter=1"):
        fit_l2_logistic(Z, y.astype(float), max_iter=1)
    with warnings_module.catch_warnings():
        warnings_module.simplefilter("error", UnconvergedFitWarning)
        fit_l2_logistic(Z, y.astype(float))


def test_a_fit_whose_newton_steps_fail_the_line_search_stops_and_is_fitted_one_at_a_time():
    """MDL's first prefix on make run's frustration layer 12 A2_max, in miniature: 4 rows of a universe where some
    features are nearly constant within the fit (scale 1e-4) but spread in the universe. The batched Newton matrix is
    then too ill-conditioned for its steps to descend; before, the line search's last resort took the step anyway and
    the coefficients went to inf."""
    rng = np.random.default_rng(7)
    X = rng.normal(size=(16, 64)) * 3.0
    rows = [np.arange(4), np.arange(4, 16)]
    X[:4, :32] = 5.0 + rng.normal(size=(4, 32)) * 1e-4  # near-constant in fit 0, spread in the universe
    y = np.tile([1, 0], 8)
    fit = fit_many(torch.as_tensor(X), rows, [y[r] for r in rows], exact=True)
    assert bool(fit.converged.all()) and bool(torch.isfinite(fit.coef).all())
    ref = NewtonLogisticProbe().fit(X[rows[0]], y[rows[0]])
    got = fit.scores(torch.as_tensor(X))[0].numpy()
    assert np.all(np.abs(got - ref.decision_function(X)) <= _evaluation_gap(ref, fit, 0, X))


def test_the_probe_loop_names_the_cell_of_an_unconverged_fit(caplog):
    import logging
    import warnings as warnings_module

    from poolbench.prober.concept_probe import fits_named
    from poolbench.prober.newton_logistic import UnconvergedFitWarning

    with (caplog.at_level(logging.WARNING, logger="poolbench.prober.concept_probe"),
          pytest.warns(DeprecationWarning, match="passes through"), fits_named("hedging", 12, "A1_mean")):
        warnings_module.warn("3 of 31 logistic fits stopped at max_iter=200", UnconvergedFitWarning, stacklevel=1)
        warnings_module.warn("passes through", DeprecationWarning, stacklevel=1)
    [record] = [r for r in caplog.records if "max_iter" in r.getMessage()]
    assert record.getMessage() == "hedging layer 12 A1_mean: 3 of 31 logistic fits stopped at max_iter=200"


def test_fits_refactored_beside_one_already_converged_keep_their_own_factors():
    """A fold with no signal stops at its cold start (every vector once with each label) while two folds with signal
    take their first Newton factor: each must get its own. The factors once sat in an expanded view of one identity,
    so writing two of them landed in one shared matrix and both fits stepped with the second's factor (make run: 654
    MDL fits that could not descend, and 28 calls that stopped at max_iter)."""
    X, y, _ = _data(80, 120, 0)
    X2, y2 = np.vstack([X, X]), np.r_[y, 1 - y]
    rows = [np.arange(160), np.arange(0, 64), np.arange(16, 80)]  # no signal, then two folds of the signal rows
    labels = [y2[r] for r in rows]
    Xt = torch.as_tensor(X2)
    init = fit_many(Xt, [np.arange(80)], [y], exact=True)
    together = fit_many(Xt, rows, labels, init=init, exact=True)
    assert together.iterations[0] == 0 and bool(together.converged.all())
    for f in (1, 2):
        alone = fit_many(Xt, [rows[f]], [labels[f]], init=init, exact=True)
        assert int(together.iterations[f]) == int(alone.iterations[0])
        # two fits stopped at the rule: their scores within the stopping rule's bound (module docstring)
        ref = NewtonLogisticProbe().fit(X2[rows[f]], labels[f])
        gap = np.abs(together.scores(Xt)[f].numpy() - alone.scores(Xt)[0].numpy())
        assert np.all(gap <= _bound(ref, X2, y2))


@pytest.mark.numerics
def test_a_cpu_s_float32_factors_are_made_in_place_by_lapack_beside_a_fit_already_converged(monkeypatch):
    """The shared-Gram path on a CPU factors in float32 with lapack_factors (torch's Cholesky copies and zeroes
    each batch around the factorization: ~10% of a cell, bench/README), also when only some fits are refactored
    (the no-signal fold stops at its cold start), and its fits stop where the per-fit path's do."""
    real_cholesky, calls = torch.linalg.cholesky, {"in_place": 0}

    def float64_only(A, *args, **kwargs):
        assert A.dtype == torch.float64, "a float32 CPU factor went through torch.linalg.cholesky"
        return real_cholesky(A, *args, **kwargs)

    def counted(A):
        calls["in_place"] += 1
        return factor_in_place(A)

    monkeypatch.setattr(torch.linalg, "cholesky", float64_only)
    monkeypatch.setattr(batched_logistic, "factor_in_place", counted)
    X, y, _ = _data(80, 120, 0)
    X2, y2 = np.vstack([X, X]), np.r_[y, 1 - y]
    rows = [np.arange(160), np.arange(0, 64), np.arange(16, 80)]
    labels = [y2[r] for r in rows]
    Xt = torch.as_tensor(X2)
    init = fit_many(Xt, [np.arange(80)], [y], exact=False)
    together = fit_many(Xt, rows, labels, init=init, exact=False)
    assert calls["in_place"] >= 2 and together.iterations[0] == 0 and bool(together.converged.all())
    for f in (1, 2):
        ref = NewtonLogisticProbe().fit(X2[rows[f]], labels[f])
        gap = np.abs(together.scores(Xt)[f].numpy() - ref.decision_function(X2))
        assert np.all(gap <= _bound(ref, X2, y2) + _evaluation_gap(ref, together, f, X2))


def test_the_newton_loop_reads_the_device_once_a_step_and_once_a_line_search_round(monkeypatch):
    """Each read of the device waits for its queue (on a GPU beside an extractor, for a time slice). The loop reads
    how many fits go on and how many refactor in one packed integer, and a line-search round's pending and stuck fits
    in another (`_counts`), where it read them in three and two: every read inside the loop is a `_counts` call (the
    other three: the two standardisers' checks and the convergence count), and a step that takes its full Newton
    step reads twice. 22 reads a cell became 10 at d1_cost's layer (bench/README, session 38)."""
    from device_reads import DeviceReads

    X, y, _ = _data(200, 40, 3)
    cells = torch.as_tensor(np.stack([X, X[::-1].copy(), X * 1.5]))
    rows = [np.arange(0, 150), np.arange(50, 200), np.r_[0:100, 150:200]]
    counted = []
    real = batched_logistic._counts
    monkeypatch.setattr(batched_logistic, "_counts", lambda a, b: counted.append(1) or real(a, b))
    with DeviceReads() as reads:
        fit = fit_many(cells, rows, [y[r] for r in rows], exact=False)
    steps = int(fit.iterations.max())
    assert bool(fit.converged.all()) and steps >= 5
    assert len(reads.reads) == len(counted) + 3
    assert len(counted) >= 2 * steps + 1  # each step and its line search, then the check that stops the loop
