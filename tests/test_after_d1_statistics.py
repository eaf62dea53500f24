"""What a run computes after its last D1 result shares its work: the pair resamples drawn once for every strategy
(a bounded memo of read-only arrays), the same-pair comparisons built without a loop in the loop's order, the
best strategy's side of the paired bootstrap computed once, one lexical fit a concept for its baseline and tiers.
Each gives the bits the unshared computation gave."""

import numpy as np
import pyarrow as pa
import pytest
from sklearn.metrics import roc_auc_score

from poolbench.corpus.passage import Passage
from poolbench.driver.breakdowns import lexical_by_tier, lexical_fits
from poolbench.prober import auroc as auroc_module
from poolbench.prober.array_memo import ArrayMemo
from poolbench.prober.auroc import auroc_batch, group_bootstrap_weights
from poolbench.prober.buckets import _same_group_comparisons
from poolbench.prober.passage_scores import HELDOUT, HeldOutCell, cell_scores_table, concat_scores
from poolbench.prober.verdicts import concept_resamples, pairs_bootstrap
from poolbench.results.answer.passage_table import read_run_scores, write_run_scores


def _frozen(values) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    array.flags.writeable = False
    return array


def test_a_memo_keeps_read_only_arrays_within_its_bytes():
    memo = ArrayMemo(max_bytes=3 * 8 * 10)  # three arrays of ten float64
    made = []

    def make(i):
        made.append(i)
        return _frozen(np.full(10, i))

    first = memo.get("a", lambda: make(0))
    assert memo.get("a", lambda: make(99)) is first and made == [0]
    for key, i in (("b", 1), ("c", 2), ("d", 3)):  # the fourth pushes out the least recently used: "a"
        memo.get(key, lambda i=i: make(i))
    assert memo.get("a", lambda: make(4)) is not first and made == [0, 1, 2, 3, 4]
    assert (memo.hits, memo.misses) == (1, 5)
    with pytest.raises(ValueError, match="read-only"):
        memo.get("e", lambda: np.zeros(3))


def test_pair_resamples_are_drawn_once_read_only_and_equal_to_a_fresh_draw():
    groups = np.array([f"pair{i // 2:02d}" for i in range(40)])
    labels = np.arange(40) % 2
    weights = group_bootstrap_weights(groups, labels, 300, 5)
    assert not weights.flags.writeable
    with pytest.raises(ValueError):
        weights[0, 0] = 7.0
    renamed = np.array([f"other{i // 2:03d}" for i in range(40)])  # the same partition in the same sorted order
    assert group_bootstrap_weights(renamed, labels, 300, 5) is weights
    auroc_module._WEIGHTS.clear()
    np.testing.assert_array_equal(group_bootstrap_weights(groups, labels, 300, 5), weights)
    assert not np.array_equal(group_bootstrap_weights(groups, labels, 300, 6), weights)


def test_the_labels_are_part_of_what_the_draws_depend_on():
    """One positive among 20 singletons: ~37% of raw draws miss it and are redrawn, so its resamples differ from
    those of a balanced labelling with the same groups and seed. A memo keyed on the groups alone would hand the
    balanced draws to the unbalanced call, and rows without a positive would give NaN AUROCs."""
    groups = np.arange(20)
    balanced = group_bootstrap_weights(groups, np.arange(20) % 2, 1000, 0)
    one = np.r_[1, np.zeros(19, dtype=int)]
    rare = group_bootstrap_weights(groups, one, 1000, 0)
    assert rare is not balanced and np.all(rare[:, 0] >= 1)
    assert np.all(np.isfinite(auroc_batch(np.linspace(0, 1, 20), one, rare)))


def _loop_comparisons(scores, labels, strata, groups):
    """The loop over sorted (stratum, group) keys the vectorised build replaced (its order is the sums' order)."""
    keys = np.char.add(np.char.add(strata.astype(str), "\x00"), groups.astype(str))
    pos_i, neg_j = [], []
    for key in np.unique(keys):
        rows = np.flatnonzero(keys == key)
        p, n = rows[labels[rows]], rows[~labels[rows]]
        pos_i.extend(np.repeat(p, n.size))
        neg_j.extend(np.tile(n, p.size))
    i, j = np.asarray(pos_i, dtype=np.int64), np.asarray(neg_j, dtype=np.int64)
    return i, j, (scores[i] > scores[j]) + 0.5 * (scores[i] == scores[j])


def test_same_pair_comparisons_come_in_the_loops_order():
    """By hand: key A/g1 holds positives 0, 4 and negative 2; A/g2 positive 1, negatives 3, 5; B/g1 a positive only.
    Sorted keys A/g1, A/g2: (0,2), (4,2), (1,3), (1,5); right where the positive scores higher, a half on a tie."""
    scores = np.array([0.9, 0.4, 0.5, 0.4, 0.1, 0.6, 0.3])
    labels = np.array([1, 1, 0, 0, 1, 0, 1]).astype(bool)
    strata = np.array(list("AAAAAAB"))
    groups = np.array(["g1", "g2", "g1", "g2", "g1", "g2", "g1"])
    i, j, right = _same_group_comparisons(scores, labels, strata, groups)
    assert i.tolist() == [0, 4, 1, 1] and j.tolist() == [2, 2, 3, 5]
    assert right.tolist() == [1.0, 0.0, 0.5, 0.0]
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 80))
        args = (rng.integers(0, 4, n).astype(float), rng.random(n) < 0.5, rng.choice(["a", "b", "ab"], n),
                rng.choice(["x", "y", "", "xy", "z"], n))
        for got, want in zip(_same_group_comparisons(*args), _loop_comparisons(*args), strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)


def test_auroc_batch_without_ties_equals_sklearn():
    """The tie-free path (no block sums) against scikit-learn's weighted AUROC, resample by resample. Both are float64
    sums of n weighted comparisons normalised to [0, 1], summed in different orders: they may differ by a few float64
    widths per term, 4·eps·n (2.7e-13 here; 1.1e-16 seen), whatever the CPU's kernels."""
    rng = np.random.default_rng(4)
    n = 300
    scores = rng.normal(size=n)
    labels = (rng.random(n) < 0.4).astype(int)
    weights = rng.integers(0, 4, size=(20, n)).astype(np.float64)
    expected = [roc_auc_score(labels, scores, sample_weight=w) for w in weights]
    tol = 4 * np.finfo(np.float64).eps * n
    np.testing.assert_allclose(auroc_batch(scores, labels, weights), expected, rtol=0, atol=tol)


def _cells(rng, shift):
    ids = np.array([f"p{i:03d}" for i in range(60)])
    labels = np.arange(60) % 2
    scores = rng.normal(size=60) + shift * labels
    return HeldOutCell(ids, np.array([f"g{i // 2}" for i in range(60)]), labels, scores)


def test_the_best_sides_resamples_computed_once_give_the_same_bootstrap():
    rng = np.random.default_rng(2)
    best = [_cells(rng, 1.0) for _ in range(3)]
    other = [_cells(rng, 0.5) for _ in range(3)]
    alone = pairs_bootstrap(best, other, n_bootstrap=400, seed=3)
    shared = pairs_bootstrap(best, other, n_bootstrap=400, seed=3,
                             best_resamples=concept_resamples(best, n_bootstrap=400, seed=3))
    assert shared == alone
    assert alone.low < alone.difference < alone.high


def _tiered_passages() -> list[Passage]:
    words = ["calm", "storm", "river", "stone", "bright", "dark", "quick", "slow"]
    out = []
    for i in range(48):
        label = i % 2
        split = "train" if i < 24 else "test"
        text = f"{words[i % 8]} {words[(i * 3) % 8]} {'angry loud' if label else 'quiet soft'} {words[(i * 5) % 8]}"
        out.append(Passage(id=f"c-{i:03d}", text=text, label=label, domain="d", token_count=5,
                           matched_pair_id=f"g{i // 2}", split=split, concept="c",
                           tier=None if split == "train" else ("standard", "hard")[(i // 2) % 2]))
    return out


def test_one_lexical_fit_serves_the_baseline_and_every_tier():
    passages = {"c": _tiered_passages()}
    refitted = lexical_by_tier(passages, n_bootstrap=50, seed=0)
    shared = lexical_by_tier(passages, n_bootstrap=50, seed=0, fits=lexical_fits(passages))
    assert [r.tier for r in refitted] == ["standard", "hard"]
    assert [r.to_dict() for r in shared] == [r.to_dict() for r in refitted]


def test_a_runs_scores_are_one_record_batch_in_the_run_folder(tmp_path):
    """Joined from 40 cells' tables, the run's scores are written as one Arrow record batch (a batch a cell made
    make run's file 7,752 batches), the same rows in the same order; no table at all is the schema's empty one."""
    cells = [cell_scores_table("c", 1, f"S{k}", "logistic", HELDOUT, np.array([f"p{k}-{i}" for i in range(5)]),
                               np.array([f"g{i}" for i in range(5)]), np.arange(5) % 2, np.linspace(0, 1, 5) + k)
             for k in range(40)]
    joined = concat_scores(cells)
    assert {column.num_chunks for column in joined.columns} == {1}
    assert joined.equals(pa.concat_tables(cells))
    write_run_scores(joined, tmp_path)
    with pa.ipc.open_file(tmp_path / "passage_scores.arrow") as stored:
        assert stored.num_record_batches == 1
    assert read_run_scores(tmp_path).equals(joined)
    assert concat_scores([]).num_rows == 0 and concat_scores([]).schema == joined.schema
