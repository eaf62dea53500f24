"""D1 by density / placement: the stratified bucket AUROC by hand, a scorer that only sees end-placed signal, the
refit probe equal to D1's, and the driver step on a constructed pooled table."""

import numpy as np
import pytest
from score_tables import stored_heldout_scores

from poolbench.corpus.passage import Passage
from poolbench.driver.breakdowns import bucket_cells, d1_by_bucket
from poolbench.prober.auroc import auroc
from poolbench.prober.buckets import bucket_aurocs, heldout_scores, stratified_auroc_batch
from poolbench.prober.d1 import evaluate_d1
from poolbench.prober.passage_scores import concat_scores
from poolbench.records.d1 import D1CellRecord


def test_stratified_auroc_compares_within_a_concept_only():
    """Concept A scores near 100, B near 0; each ranks its own passages perfectly, so the stratified AUROC is 1.
    Pooling the scores would compare B's positive (1) with A's negative (100): 3 of 4 pairs, 0.75."""
    scores, labels, strata = np.array([101.0, 100.0, 1.0, 0.0]), np.array([1, 0, 1, 0]), np.array(list("AABB"))
    assert stratified_auroc_batch(scores, labels, strata, np.ones((1, 4)))[0] == 1.0
    assert auroc(scores, labels) == 0.75


def test_stratified_auroc_weights_each_concept_by_its_pairs():
    """A: 2 pos, 2 neg, AUROC 3/4 (4 pairs); B: 1 pos, 1 neg ranked wrong, AUROC 0 (1 pair): (3 + 0) / 5 = 0.6."""
    scores = np.array([0.9, 0.2, 0.5, 0.1, 0.0, 1.0])
    labels = np.array([1, 1, 0, 0, 1, 0])
    strata = np.array(list("AAAABB"))
    assert stratified_auroc_batch(scores, labels, strata, np.ones((1, 6)))[0] == pytest.approx(0.6)
    out = bucket_aurocs(scores, labels, np.array(["g1", "g2", "g1", "g2", "g3", "g3"]), strata,
                        np.array(["x"] * 6), n_bootstrap=200)
    # Across pairs only: A keeps 0.9 (g1) > 0.1 (g2) right and 0.2 (g2) < 0.5 (g1) wrong; B's one comparison is
    # a twin's, left out: 1 / 2. Counting twins gives the 0.6 above.
    assert [(b.bucket, b.auroc, b.auroc_with_twins, b.n, b.n_pos, b.n_neg, b.n_strata) for b in out] == [
        ("x", pytest.approx(0.5), pytest.approx(0.6), 6, 3, 3, 2)]
    assert out[0].stratum_aurocs == {"A": 0.5, "B": None}


def test_bucket_auroc_leaves_out_twin_comparisons():
    """Per pair a distinct base score; the positive sits 0.001 above its own twin only. Across pairs the order is
    the bases' (half right, 0.5 exactly); counting twins adds n right comparisons: (n(n-1)/2 + n) / n^2 = 9/16."""
    n = 8
    base = np.arange(n, dtype=float)
    scores = np.r_[base + 0.001, base]
    labels = np.r_[np.ones(n, dtype=int), np.zeros(n, dtype=int)]
    groups = np.r_[np.arange(n), np.arange(n)].astype(str)
    (b,) = bucket_aurocs(scores, labels, groups, np.array(["c"] * 2 * n), np.array(["x"] * 2 * n), n_bootstrap=200)
    assert b.auroc == pytest.approx(0.5, abs=1e-12)
    assert b.auroc_with_twins == pytest.approx(9 / 16)
    assert b.ci_low <= 0.5 <= b.ci_high


def test_a_scorer_that_sees_only_end_placed_signal():
    """Per matched pair a shared base score in [0, 1); the positive gets +10 only when its signal sits at the end.
    End buckets: every positive outscores every negative of its concept (1.0). Start: each pair scores alike, so
    positives and negatives are one multiset per concept and the AUROC is exactly 0.5 - the bad case."""
    rng = np.random.default_rng(0)
    scores, labels, groups, strata, placement = [], [], [], [], []
    for concept in ("c1", "c2", "c3"):
        for pair in range(8):
            where = "end" if pair % 2 else "start"
            base = rng.random() + (100.0 if concept == "c2" else 0.0)  # c2's probe lives on another scale
            for label in (1, 0):
                scores.append(base + (10.0 if label and where == "end" else 0.0))
                labels.append(label)
                groups.append(f"p{pair}")  # the same pair ids in every concept: units are (concept, pair)
                strata.append(concept)
                placement.append(where)
    out = {b.bucket: b for b in bucket_aurocs(np.array(scores), np.array(labels), np.array(groups),
                                              np.array(strata), np.array(placement), n_bootstrap=300,
                                              order=("start", "middle", "end", "spread"))}
    assert list(out) == ["start", "end"]
    assert (out["end"].auroc, out["end"].ci_low, out["end"].ci_high) == (1.0, 1.0, 1.0)
    assert out["start"].auroc == pytest.approx(0.5, abs=1e-12)
    assert (out["start"].ci_low, out["start"].ci_high) == (0.5, 0.5)  # a resample keeps pairs whole: still 0.5
    assert (out["end"].n, out["end"].n_strata) == (24, 3)


def test_heldout_scores_are_d1s_test_scores():
    """The refit probe is D1's: over every bucket of one concept, its AUROC counting twins is the cell's D1 test
    AUROC."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(40, 6))
    y = np.tile([1, 0], 20)
    X[y == 1, 0] += 0.8
    groups = np.repeat([f"g{i}" for i in range(20)], 2)
    d1 = evaluate_d1(X[:24], y[:24], groups[:24], X[24:], y[24:], groups[24:], n_bootstrap=50, probes=("logistic",))
    scores = heldout_scores(X[:24], y[:24], X[24:])
    np.testing.assert_allclose(scores, d1["logistic"].test_scores)
    whole = bucket_aurocs(scores, y[24:], groups[24:], np.array(["c"] * 16), np.array(["all"] * 16), n_bootstrap=50)
    assert whole[0].auroc_with_twins == d1["logistic"].test_auroc


def _cell(concept: str, layer: int, strategy: str, cv: float, test: float) -> D1CellRecord:
    return D1CellRecord(concept=concept, layer=layer, strategy=strategy, probe="logistic", cv_auroc=cv,
                        test_auroc=test, ci_low=test - 0.1, ci_high=min(1.0, test + 0.1))


def test_bucket_cells_pick_the_best_strategy_and_the_fixed_ones_at_their_cv_layer():
    """S3_iti_probe (supervised) is the best on held-out D1: its stored scores are the fit that reported it, so it
    is read like any other (a refit could not repeat its per-fold heads; nothing refits now)."""
    records = [_cell("c", 0, "A1_mean", 0.9, 0.8), _cell("c", 1, "A1_mean", 0.7, 0.95),
               _cell("c", 0, "S3_iti_probe", 0.99, 0.99), _cell("c", 0, "L4_clause", 0.8, 0.9),
               _cell("c", 1, "L4_clause", 0.95, 0.85), _cell("c", 0, "W2_last_k", 0.6, 0.6)]
    assert bucket_cells(records) == {"S3_iti_probe": 0, "A1_mean": 0, "W2_last_k": 0}


def test_d1_by_bucket_reads_the_stored_scores_and_buckets_by_density_and_placement():
    """A pair's two scores share their noise; W2_last_k's carry the label only when the signal sits at the end,
    A1_mean's always. So W2 reads 1.0 on end-placed (density 1) pairs and exactly 0.5 on start-placed ones."""
    rng = np.random.default_rng(2)
    passages, rows = [], []
    for i in range(32):
        split = "train" if i < 20 else "test"
        where, density = ("end", 1) if i % 2 else ("start", 2)
        noise = 0.3 * rng.normal(size=4)
        for label in (1, 0):
            passages.append(Passage(id=f"p{i}-{label}", text="x", label=label, domain="d", token_count=1,
                                    matched_pair_id=f"pair{i}", split=split, concept="c", signal_spans=((0, 1),),
                                    density=density, placement=where))
            a1 = noise + np.array([3.0 * label, 0, 0, 0])
            w2 = noise + np.array([3.0 * label if where == "end" else 0.0, 0, 0, 0])
            rows.append((a1, w2))
    scores = stored_heldout_scores(passages, {"A1_mean": [a1[0] for a1, _ in rows],
                                              "W2_last_k": [w2[0] for _, w2 in rows]})
    records = [_cell("c", 0, "A1_mean", 0.99, 0.99), _cell("c", 0, "W2_last_k", 0.8, 0.75)]
    out = d1_by_bucket(scores, {"c": passages}, records, n_bootstrap=100, seed=0)
    got = {(r.strategy, r.by, r.bucket): r for r in out}
    assert list(got) == [("A1_mean", "density", "1"), ("A1_mean", "density", "2"),
                         ("A1_mean", "placement", "start"), ("A1_mean", "placement", "end"),
                         ("W2_last_k", "density", "1"), ("W2_last_k", "density", "2"),
                         ("W2_last_k", "placement", "start"), ("W2_last_k", "placement", "end")]
    assert got[("W2_last_k", "placement", "end")].auroc == 1.0
    assert got[("W2_last_k", "density", "1")].auroc == 1.0
    assert got[("W2_last_k", "placement", "start")].auroc == pytest.approx(0.5, abs=1e-12)
    assert got[("W2_last_k", "density", "2")].auroc == pytest.approx(0.5, abs=1e-12)
    assert got[("A1_mean", "placement", "start")].auroc == got[("A1_mean", "placement", "end")].auroc == 1.0
    assert got[("W2_last_k", "placement", "end")].n == 12 and got[("W2_last_k", "placement", "end")].layer == 0


def test_a_corpus_without_density_gets_no_buckets():
    plain = [Passage(id="a", text="x", label=1, domain="d", token_count=1, matched_pair_id=None, split="test",
                     concept="c")]
    assert d1_by_bucket(concat_scores([]), {"c": plain}, [], n_bootstrap=10, seed=0) == []
