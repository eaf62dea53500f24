"""Flash subsets: stratified and pair-preserving, one-line errors; fraction 1 gives resolution 0 and tau 1."""

from __future__ import annotations

import numpy as np
import pytest

from poolbench.errors import PoolBenchError
from poolbench.prober.flash import FlashError, flash_subset, parse_fraction, rank_resolution


def test_flash_subset_keeps_pairs_and_balance():
    y = np.r_[np.ones(64, dtype=int), np.zeros(64, dtype=int)]
    groups = np.r_[np.arange(64), np.arange(64)].astype(str)
    rows = flash_subset(y, groups, parse_fraction("1/8"), seed=3, concept="negation")
    assert rows.size == 16 and y[rows].sum() == 8
    kept = groups[rows]
    assert all(np.sum(kept == g) == 2 for g in set(kept))
    assert np.array_equal(flash_subset(y, groups, 1, seed=3), np.arange(128))
    assert np.array_equal(rows, flash_subset(y, groups, parse_fraction("1/8"), seed=3))


def test_flash_errors_are_one_line_and_name_the_concept():
    y = np.r_[np.ones(10, dtype=int), np.zeros(10, dtype=int)]
    groups = np.r_[np.arange(10), np.arange(10)]
    with pytest.raises(PoolBenchError) as err:
        flash_subset(y, groups, parse_fraction("1/64"), concept="sarcasm")
    assert "sarcasm" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(FlashError, match="needs >= 5"):
        flash_subset(y, groups, parse_fraction("1/4"), concept="sarcasm", min_per_class=5)
    for bad in ("0", "3/2", "one half"):
        with pytest.raises(FlashError):
            parse_fraction(bad)


def test_fraction_one_has_resolution_zero_and_tau_one():
    rng = np.random.default_rng(0)
    full = rng.uniform(0.5, 1.0, size=(30, 6))
    out = rank_resolution(full, full.copy(), n_bootstrap=200)
    assert out.resolution == 0.0 and out.kendall_tau == pytest.approx(1.0)
    assert np.all(out.low == 0) and np.all(out.high == 0)


def test_noisy_flash_ranking_has_positive_resolution():
    rng = np.random.default_rng(1)
    full = np.linspace(0.6, 0.9, 6)[None, :] + rng.normal(0, 0.02, size=(30, 6))
    flash = full + rng.normal(0, 0.1, size=full.shape)
    out = rank_resolution(full, flash, n_bootstrap=300)
    assert out.resolution >= 1 and out.kendall_tau < 1


def test_flash_check_command(tmp_path):
    import json

    from reliability_run import cli, make_run
    from typer.testing import CliRunner

    run = make_run(tmp_path)
    runner = CliRunner()
    result = runner.invoke(cli(), ["flash-check", "--run", str(run), "--fractions", "1,1/2,1/8",
                                   "--n-bootstrap", "100"])
    assert result.exit_code == 0, result.output
    rows = json.loads((run / "flash_check.json").read_text())["fractions"]
    assert [r["fraction"] for r in rows] == ["1", "1/2", "1/8"]
    assert rows[0]["rank_resolution"] == 0.0 and rows[0]["kendall_tau"] == pytest.approx(1.0)
    result = runner.invoke(cli(), ["flash-check", "--run", str(run), "--fractions", "1/128"])
    assert isinstance(result.exception, FlashError) and "negation" in str(result.exception)
