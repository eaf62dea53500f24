"""D1 per tier on a constructed pooled table: a representation that carries only what the words say reads 1.0 on
the standard tier and exactly 0.5 on the hard one; the leaderboard section says whether the best one separates."""

import numpy as np
import pytest
from score_tables import stored_heldout_scores

from poolbench.corpus.passage import Passage
from poolbench.driver.breakdowns import d1_by_tier, has_tiers, lexical_by_tier
from poolbench.prober.passage_scores import concat_scores
from poolbench.records.breakdowns import TierAurocRecord
from poolbench.records.d1 import D1CellRecord
from poolbench.results.answer.tiers import tier_section


def _cell(strategy: str, cv: float) -> D1CellRecord:
    return D1CellRecord(concept="c", layer=0, strategy=strategy, probe="logistic", cv_auroc=cv, test_auroc=cv,
                        ci_low=cv - 0.1, ci_high=min(1.0, cv + 0.1))


def test_words_only_strategy_is_at_chance_on_the_hard_tier():
    """A pair's two held-out scores share their noise. WORDS adds the label only on standard pairs (a hard pair's
    words are the same on both sides), MEANING on every pair: WORDS reads 1.0 on standard and exactly 0.5 on hard,
    since each hard positive scores what its negative does; MEANING reads 1.0 on both. S3_sup, a supervised
    strategy, is read from its stored scores like the others (it was left out when tiers refitted probes)."""
    rng = np.random.default_rng(3)
    passages, rows = [], []
    for i in range(40):
        split = "train" if i < 24 else "test"
        tier = "hard" if i % 2 else "standard"
        noise = 0.3 * rng.normal(size=4)
        for label in (1, 0):
            passages.append(Passage(id=f"p{i}-{label}", text="x", label=label, domain="d", token_count=1,
                                    matched_pair_id=f"pair{i}", split=split, concept="c", tier=tier))
            words = noise + np.array([3.0 * label if tier == "standard" else 0.0, 0, 0, 0])
            meaning = noise + np.array([3.0 * label, 0, 0, 0])
            rows.append((words, meaning))
    scores = stored_heldout_scores(passages, {"WORDS": [w[0] for w, _ in rows], "MEANING": [m[0] for _, m in rows],
                                              "S3_sup": [-w[0] for w, _ in rows]})
    records = [_cell("WORDS", 0.8), _cell("MEANING", 0.99), _cell("S3_sup", 0.99)]
    out = d1_by_tier(scores, {"c": passages}, records, n_bootstrap=200, seed=0)
    got = {(r.strategy, r.tier): r for r in out}
    assert list(got) == [("MEANING", "standard"), ("MEANING", "hard"), ("S3_sup", "standard"), ("S3_sup", "hard"),
                         ("WORDS", "standard"), ("WORDS", "hard")]
    assert got[("S3_sup", "standard")].auroc == 0.0  # its scores are WORDS' negated: read as stored, not refitted
    assert got[("WORDS", "standard")].auroc == 1.0 and got[("MEANING", "hard")].auroc == 1.0
    assert got[("WORDS", "hard")].auroc == pytest.approx(0.5, abs=1e-12)
    # counting each hard positive against its own twin too: the words give exactly one tie per pair, still 0.5
    assert got[("WORDS", "hard")].comparisons == "across_pairs"
    assert got[("WORDS", "hard")].auroc_with_twins == pytest.approx(0.5, abs=1e-12)
    assert got[("MEANING", "hard")].auroc_with_twins == 1.0
    assert (got[("WORDS", "hard")].n, got[("WORDS", "hard")].n_pos) == (16, 8)
    # the leaderboard section: MEANING's CI [1, 1] lies above WORDS' 0.5 on hard, so it separates there
    section = tier_section(out)
    assert section["hard"]["best"] == "MEANING" and section["hard"]["excluded_by_best"] == ["S3_sup", "WORDS"]
    assert section["hard"]["separates"] is True
    # on standard only the sign-flipped S3_sup (AUROC 0) lies below the best; WORDS and MEANING both read 1.0
    assert section["standard"]["excluded_by_best"] == ["S3_sup"]


def test_no_tiers_no_records():
    plain = [Passage(id="a", text="x", label=1, domain="d", token_count=1, matched_pair_id=None, split="test",
                     concept="c")]
    assert not has_tiers({"c": plain})
    assert d1_by_tier(concat_scores([]), {"c": plain}, [], n_bootstrap=10, seed=0) == []


def _tier(strategy: str, auroc: float, low: float, high: float) -> TierAurocRecord:
    return TierAurocRecord(strategy=strategy, layer=0, probe="logistic", tier="hard", auroc=auroc, ci_low=low,
                           ci_high=high, ci_level=0.95, n=16, n_pos=8, n_neg=8, n_concepts=1, n_bootstrap=10,
                           concept_aurocs={})


def test_tier_section_with_one_strategy_cannot_separate():
    assert tier_section([_tier("A", 0.7, 0.6, 0.8)])["hard"]["separates"] is False


def test_a_best_strategy_at_chance_separates_nothing():
    """A at 0.5 [0.42, 0.62] lies above B's 0.39, but a best one whose CI holds chance separates nothing."""
    hard = tier_section([_tier("A", 0.5, 0.42, 0.62), _tier("B", 0.39, 0.27, 0.45)])["hard"]
    assert (hard["best"], hard["excluded_by_best"], hard["best_above_chance"]) == ("A", ["B"], False)
    assert hard["separates"] is False


def test_lexical_by_tier_on_same_word_pairs():
    """Hard pairs swap two words' order: the bag of words sees the same text twice (0.5); standard pairs differ by
    a word the train split teaches (1.0)."""
    passages = []
    for i in range(24):
        split = "train" if i < 16 else "test"
        tier = "hard" if i % 2 else "standard"
        for label in (1, 0):
            if tier == "standard":
                text = f"item {i} is {'great' if label else 'awful'}"
            else:
                text = f"dog {i} bites man" if label else f"man {i} bites dog"
            passages.append(Passage(id=f"p{i}-{label}", text=text, label=label, domain="d", token_count=4,
                                    matched_pair_id=f"pair{i}", split=split, concept="c", tier=tier))
    got = {r.tier: r for r in lexical_by_tier({"c": passages}, n_bootstrap=50, seed=0)}
    assert got["standard"].test_auroc == 1.0
    assert got["hard"].test_auroc == 0.5 and got["hard"].n_test == 8


def test_results_and_leaderboard_carry_the_tiers(tmp_path):
    """The run's per-tier records reach results.json as typed records and leaderboard.json as its by_tier section."""
    import json
    from dataclasses import replace

    from test_cli_board import outcome

    from poolbench.records.breakdowns import LexicalTierRecord
    from poolbench.results.documents.document import write_run_outputs

    tiers = [TierAurocRecord(strategy=s, layer=2, probe="logistic", tier="hard", auroc=a, ci_low=lo, ci_high=hi,
                             ci_level=0.95, n=16, n_pos=8, n_neg=8, n_concepts=1, n_bootstrap=10, concept_aurocs={})
             for s, a, lo, hi in (("A", 0.9, 0.8, 1.0), ("B", 0.6, 0.4, 0.8), ("C", 0.85, 0.7, 0.95))]
    lexical = [LexicalTierRecord(concept=c, tier="hard", test_auroc=0.5, ci_low=0.5, ci_high=0.5, ci_level=0.95,
                                 n_test=16, n_bootstrap=10) for c in ("x", "y")]
    paths = write_run_outputs(replace(outcome(), d1_tiers=tiers, lexical_tiers=lexical), tmp_path)
    results = json.loads(paths["results"].read_text())
    assert [TierAurocRecord.from_dict(r) for r in results["d1_by_tier"]] == tiers
    assert [LexicalTierRecord.from_dict(r) for r in results["lexical_by_tier"]] == lexical
    hard = json.loads(paths["leaderboard"].read_text())["by_tier"]["hard"]
    assert [r["strategy"] for r in hard["rows"]] == ["A", "C", "B"]
    # A's CI low 0.8 lies above B's 0.6 but not C's 0.85: one of two others, at least a third
    assert (hard["excluded_by_best"], hard["separates"]) == (["B"], True)
    assert hard["lexical"] == {"mean": 0.5, "max": 0.5, "per_concept": {"x": 0.5, "y": 0.5}}
