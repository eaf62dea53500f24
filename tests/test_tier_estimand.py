"""The declared tier estimand: within-tier D1 mixed 1/2 standard + 1/2 hard, by hand; a split whose blend ranks the
other way (should-fail of the overall D1); the declaration in results.json, the leaderboard and the answer."""

from __future__ import annotations

import json

import pytest

from poolbench.config import RunConfig
from poolbench.corpus.passage import Passage
from poolbench.prober.auroc import auroc
from poolbench.records.breakdowns import TierAurocRecord
from poolbench.records.d1 import D1CellRecord
from poolbench.records.run import RunOutcome
from poolbench.results.answer.answer import build_answer
from poolbench.results.answer.ranking import mean_t_interval
from poolbench.results.answer.tier_estimand import estimand_sentence, tier_mixed_ranking, tier_pair_counts
from poolbench.results.documents.document import write_run_outputs

CONCEPTS = ("c1", "c2", "c3")
# A is strong on standard pairs and at chance on hard ones; B is good on both, a little weaker on standard.
TIER_AUROCS = {"A": {"standard": (0.95, 0.97, 0.93), "hard": (0.50, 0.55, 0.45)},
               "B": {"standard": (0.85, 0.87, 0.83), "hard": (0.75, 0.80, 0.70)}}


def _tier_records() -> list[TierAurocRecord]:
    return [TierAurocRecord(strategy=s, layer=2, probe="logistic", tier=t, auroc=sum(v) / 3, ci_low=None,
                            ci_high=None, ci_level=0.95, n=24, n_pos=12, n_neg=12, n_concepts=3, n_bootstrap=0,
                            concept_aurocs=dict(zip(CONCEPTS, v, strict=True)))
            for s, tiers in TIER_AUROCS.items() for t, v in tiers.items()]


def test_mixed_d1_by_hand():
    """A: per concept 0.5 * 0.95 + 0.5 * 0.50 = 0.725, 0.76, 0.69 -> 0.725; B: 0.80, 0.835, 0.765 -> 0.80."""
    section = tier_mixed_ranking(_tier_records())
    rows = {r["strategy"]: r for r in section["rows"]}
    assert rows["A"]["per_concept"] == pytest.approx({"c1": 0.725, "c2": 0.76, "c3": 0.69})
    assert rows["A"]["d1_mix"] == pytest.approx(0.725) and rows["B"]["d1_mix"] == pytest.approx(0.80)
    _, low, high = mean_t_interval([0.80, 0.835, 0.765])
    assert (rows["B"]["ci_low"], rows["B"]["ci_high"]) == pytest.approx((low, high))
    assert [r["strategy"] for r in section["rows"]] == ["B", "A"] and section["best"] == "B"
    assert section["mix"] == {"standard": 0.5, "hard": 0.5} and section["estimand"] == "tier_mixed_d1"
    with pytest.raises(ValueError, match="summing to 1"):
        tier_mixed_ranking(_tier_records(), {"standard": 0.7, "hard": 0.7})


def test_a_split_mostly_of_standard_pairs_ranks_the_other_way():
    """Should-fail of ranking on the overall D1: one concept's test split of 9 standard pairs and 1 hard pair, the
    scores built so A separates every standard pair and no hard one and B separates 7 of 9 standard pairs and the hard
    one. The pooled AUROC ranks A first, a blend set by the split's 10% hard pairs; the declared mix ranks B."""
    labels = [1, 0] * 10
    tiers = ["standard"] * 18 + ["hard"] * 2
    a = [2.0, 0.0] * 9 + [0.0, 1.0]  # hard positive below its negative
    b = [2.0, 0.0] * 7 + [0.0, 1.0] * 2 + [3.0, -1.0]
    assert auroc(a, labels) > auroc(b, labels)

    def within(scores, tier):
        idx = [i for i, t in enumerate(tiers) if t == tier]
        return auroc([scores[i] for i in idx], [labels[i] for i in idx])

    records = [TierAurocRecord(strategy=s, layer=1, probe="logistic", tier=t, auroc=within(v, t), ci_low=None,
                               ci_high=None, ci_level=0.95, n=2, n_pos=1, n_neg=1, n_concepts=1, n_bootstrap=0,
                               concept_aurocs={"c1": within(v, t)})
               for s, v in (("A", a), ("B", b)) for t in ("standard", "hard")]
    assert tier_mixed_ranking(records)["best"] == "B"


def _passages() -> list[Passage]:
    """2 standard + 1 hard train pairs, 1 standard + 2 hard test pairs."""
    plan = [("train", "standard", 2), ("train", "hard", 1), ("test", "standard", 1), ("test", "hard", 2)]
    out, k = [], 0
    for split, tier, n in plan:
        for _ in range(n):
            out += [Passage(id=f"p{k}{side}", text="x", label=label, domain="d", token_count=1,
                            matched_pair_id=f"g{k}", split=split, concept="c1", tier=tier)
                    for side, label in (("a", 1), ("b", 0))]
            k += 1
    return out


def test_results_leaderboard_and_answer_declare_the_estimand(tmp_path):
    counts = tier_pair_counts({"c1": _passages()})
    assert counts == {"test": {"standard": 1, "hard": 2}, "train": {"standard": 2, "hard": 1}}
    records = [D1CellRecord(concept=c, layer=2, strategy=s, probe="logistic", cv_auroc=0.8, test_auroc=0.8,
                            ci_low=0.7, ci_high=0.9) for s in TIER_AUROCS for c in CONCEPTS]
    outcome = RunOutcome(config=RunConfig(steering=False), model={"model_id": "m"},
                         corpus={"hash": "h", "tier_pairs": counts}, layers=[2],
                         strategies=[{"id": s, "family": "f"} for s in TIER_AUROCS], records=records, artifacts={},
                         d1_tiers=_tier_records())
    paths = write_run_outputs(outcome, tmp_path, stamp="s")
    results, leaderboard = (json.loads(paths[k].read_text()) for k in ("results", "leaderboard"))
    for document in (results, leaderboard):
        assert document["estimand"]["estimand"] == "tier_mixed_d1" and document["estimand"]["best"] == "B"
        assert document["estimand"]["split_hard_share"] == pytest.approx({"test": 2 / 3, "train": 1 / 3})
    sentence = estimand_sentence(leaderboard["estimand"])
    assert sentence is not None and sentence.startswith(
        "Ranked on the declared estimand (within-tier D1 mixed standard 0.5, hard 0.5; the overall D1 blends them "
        "at the test split's 67% hard pairs): first B at layer 2, 0.800 [")
    assert sentence in build_answer(results, leaderboard).sentences


def _outcome_ranked_both_ways() -> RunOutcome:
    """A run whose blend and estimand disagree: A's overall held-out AUROC (0.90, the blend of a split mostly of
    standard pairs) and its CV (0.85) are above B's (0.80, 0.80), while B's D1_mix (0.80) is above A's (0.725)."""
    values = {"A": (0.85, 0.90), "B": (0.80, 0.80)}
    records = [D1CellRecord(concept=c, layer=2, strategy=s, probe="logistic", cv_auroc=cv + k / 100,
                            test_auroc=test + k / 100, ci_low=0.6, ci_high=0.95, n_train=24, n_folds=3)
               for s, (cv, test) in values.items() for k, c in enumerate(CONCEPTS)]
    counts = tier_pair_counts({"c1": _passages()})
    return RunOutcome(config=RunConfig(steering=False), model={"model_id": "m"},
                      corpus={"hash": "h", "tier_pairs": counts}, layers=[2],
                      strategies=[{"id": s, "family": "f"} for s in values], records=records, artifacts={},
                      d1_tiers=_tier_records())


def test_the_leaderboard_and_the_answer_rank_on_the_estimand_with_the_blend_shown(tmp_path):
    from rich.console import Console

    from poolbench.cli.board import leaderboard_table
    from poolbench.results.answer.answer import read_answer
    from poolbench.results.answer.leaderboard import build_leaderboard
    from poolbench.results.pages.findings import findings_facts, render_findings

    outcome = _outcome_ranked_both_ways()
    # should-fail: on the blend alone A is first
    blend = build_leaderboard(outcome.records)
    assert [r["strategy"] for r in blend["strategies"]] == ["A", "B"] and blend["ranked_on"] == "test_auroc"
    paths = write_run_outputs(outcome, tmp_path, stamp="s")
    results, board = (json.loads(paths[k].read_text()) for k in ("results", "leaderboard"))
    assert board["ranked_on"] == "tier_mixed_d1" and "D1_mix" in board["ranking"]
    rows = board["strategies"]
    assert [(r["rank"], r["strategy"]) for r in rows] == [(1, "B"), (2, "A")]
    assert [r["d1_mix"] for r in rows] == pytest.approx([0.80, 0.725])  # by hand, test_mixed_d1_by_hand
    assert [r["mean_d1"] for r in rows] == pytest.approx([0.81, 0.91])  # the blend, still shown
    assert rows[0]["per_concept"]["c2"]["d1_mix"] == pytest.approx(0.835)
    assert rows[0]["d1_mix_concepts"] == 3
    _, low, high = mean_t_interval([0.80, 0.835, 0.765])
    assert (rows[0]["d1_mix_ci_low"], rows[0]["d1_mix_ci_high"]) == pytest.approx((low, high))

    answer = read_answer(paths["answer"])
    assert answer.ranked_on == "tier_mixed_d1"
    assert answer.best is not None and answer.best.strategy == "A"  # chosen on CV, as ever
    assert answer.best.d1_mix is not None and answer.best.d1_mix.value == pytest.approx(0.725)
    assert answer.best.d1.value == pytest.approx(0.91)
    v = answer.verdicts
    assert v is not None and v.measure == "tier_mixed_d1"
    (other,) = v.comparisons
    assert other.mean_difference == pytest.approx(0.725 - 0.80)  # best minus B, on D1_mix, not 0.91 - 0.81
    assert v.best.test_top == "B" and v.best.test_mean == pytest.approx(0.725)
    assert any(s.startswith("Held-out on the declared estimand, D1_mix 0.725 [") for s in answer.sentences)
    assert any("held-out mean D1_mix" in s for s in answer.sentences)

    console = Console(record=True, width=200)
    console.print(leaderboard_table(board, answer))
    printed = " ".join(console.export_text().split())
    assert "ranked on D1_mix, the declared tier estimand" in printed and "D1_mix [95% CI]" in printed
    assert "mean D1, the overall held-out AUROC, blends the tiers" in printed
    page = render_findings(findings_facts(results, board, source="r", sha256="0" * 64, answer=answer))
    assert "ranked on the declared estimand D1_mix (within-tier held-out AUROCs mixed standard 0.5, hard 0.5)" in page
    assert "| 1 | B | f | 2 | 0.800 [" in page
    wide = (tmp_path / "leaderboard_wide.csv").read_text().splitlines()
    assert wide[0].split(",")[7:10] == ["d1_mix", "d1_mix_low", "d1_mix_high"] and wide[1].split(",")[1] == "B"


def test_a_strategy_without_d1_mix_puts_the_run_on_the_blend_and_the_board_says_which(tmp_path):
    """B has no tier records: the estimand cannot rank every strategy, so the board ranks on the blend (A first)
    and its title and caption name the missing strategy instead of reading as if nothing had been declared."""
    from dataclasses import replace

    from rich.console import Console

    from poolbench.cli.board import leaderboard_table
    from poolbench.results.answer.leaderboard import ranked_on_text

    outcome = _outcome_ranked_both_ways()
    outcome = replace(outcome, d1_tiers=[r for r in outcome.d1_tiers if r.strategy == "A"])
    paths = write_run_outputs(outcome, tmp_path, stamp="s")
    board = json.loads(paths["leaderboard"].read_text())
    assert board["ranked_on"] == "test_auroc" and board["estimand_missing"] == ["B"]
    assert [r["strategy"] for r in board["strategies"]] == ["A", "B"]
    assert ranked_on_text(board).endswith("the declared estimand D1_mix has no value for B at the CV-chosen layer")
    console = Console(record=True, width=240)
    console.print(leaderboard_table(board))
    printed = " ".join(console.export_text().split())
    assert "ranked on held-out AUROC, not the declared D1_mix (see below)" in printed
    assert "D1_mix has no value for B" in printed
    # should-fail: with every strategy covered there is nothing to name
    full = json.loads(write_run_outputs(_outcome_ranked_both_ways(), tmp_path / "full", stamp="s")["leaderboard"]
                      .read_text())
    assert "estimand_missing" not in full
