"""The answer's comparisons: the best is chosen on CV alone, and each other strategy's one verdict comes from
Wilcoxon-Holm and the Bayesian signed-rank test with a ROPE, checked by hand; should-fail runs go through the
answer-writing path (write_run_outputs -> answer.json -> the printed answer)."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from functools import partial

import numpy as np
import pyarrow as pa
import pytest
from scipy.stats import beta, nct
from scipy.stats import t as student_t

from poolbench.config import RunConfig
from poolbench.prober.auroc import ProbeError
from poolbench.prober.passage_scores import HELDOUT, cell_scores_table, concat_scores, held_out_cells
from poolbench.prober.verdicts import (
    bayesian_signed_rank,
    choose_on_cv,
    compare_strategies,
    concepts_to_separate,
    holm_adjusted,
    pairs_bootstrap,
    rank_intervals,
)
from poolbench.records.d1 import D1CellRecord
from poolbench.records.run import RunOutcome
from poolbench.records.verdicts import CONFIRMED, CONTRADICTED, EQUIVALENT, NOT_CONTRADICTED, NOT_SEPARATED, WORSE
from poolbench.results.answer.answer import ANSWER_FILE, AnswerSection, answer_text, read_answer, write_answer
from poolbench.results.documents.document import write_run_outputs

SAMPLES = 20_000  # posterior samples (the default): a share p carries binomial sd sqrt(p (1 - p) / SAMPLES)


def mc_tolerance(p: float) -> float:
    """Five binomial standard deviations of a Monte Carlo share, never below one sample."""
    return max(5.0 * math.sqrt(p * (1.0 - p) / SAMPLES), 1.0 / SAMPLES)


def exact_wilcoxon_p(d: np.ndarray) -> float:
    """Two-sided exact p of the signed-rank test by enumerating all 2^n sign patterns (distinct |d|, no zeros)."""
    ranks = np.argsort(np.argsort(np.abs(d))) + 1
    observed = min(ranks[d > 0].sum(), ranks[d < 0].sum())
    sums = [sum(r for r, s in zip(ranks, signs, strict=True) if s) for signs in itertools.product((0, 1),
                                                                                                   repeat=d.size)]
    return min(1.0, 2.0 * sum(1 for w in sums if w <= observed) / len(sums))


def run_of(per_concept: dict[str, np.ndarray], cv_bonus: dict[str, float] | None = None) -> RunOutcome:
    """A finished run of one layer: held-out AUROC per strategy and concept as given, CV AUROC the same plus a
    strategy's bonus (so the CV choice is set by hand)."""
    bonus = cv_bonus or {}
    records = [D1CellRecord(concept=f"c{i:03d}", layer=2, strategy=s, probe="logistic",
                            cv_auroc=float(v) + bonus.get(s, 0.0), test_auroc=float(v), ci_low=float(v) - 0.05,
                            ci_high=min(1.0, float(v) + 0.05))
               for s, values in per_concept.items() for i, v in enumerate(values)]
    return RunOutcome(config=RunConfig(steering=False, n_bootstrap=200), model={"model_id": "m"},
                      corpus={"hash": "h"}, layers=[2], strategies=[{"id": s, "family": "f"} for s in per_concept],
                      records=records, artifacts={}, timing={"total_s": 1.0})


def written_answer(tmp_path, per_concept: dict[str, np.ndarray], cv_bonus: dict[str, float] | None = None):
    paths = write_run_outputs(run_of(per_concept, cv_bonus), tmp_path, stamp="s")
    return read_answer(paths["answer"])


def verdict(answer, strategy: str) -> str:
    assert answer.verdicts is not None
    return next(c.verdict for c in answer.verdicts.comparisons if c.strategy == strategy)


def base(n: int) -> np.ndarray:
    return 0.7 + 0.25 * np.arange(n) / n  # concepts differ in difficulty; strategies are compared within each


def equal_pair(n: int) -> dict[str, np.ndarray]:
    """Two strategies whose per-concept differences are ±0.015 in turn (mean 0 at even n): equal, with a spread
    of 1.5 ROPE widths that only many concepts average out."""
    d = np.resize([0.015, -0.015], n)
    return {"A": base(n) + d / 2, "B": base(n) - d / 2}


def test_equal_strategies_are_equivalent_with_many_concepts_and_not_separated_with_few(tmp_path):
    many = written_answer(tmp_path / "many", equal_pair(80), {"A": 0.01})
    assert verdict(many, "B") == EQUIVALENT
    b = many.verdicts.comparisons[0]
    assert b.p_rope >= 0.95 and b.holm_p == 1.0 and b.n_concepts == 80 and b.test == "Bayesian signed-rank test, ROPE"
    few = written_answer(tmp_path / "few", equal_pair(6), {"A": 0.01})
    assert verdict(few, "B") == NOT_SEPARATED
    assert few.verdicts.comparisons[0].p_rope < 0.95
    assert few.verdict == "set" and set(few.verdicts.confidence_set) == {"A", "B"}
    # The mean difference is exactly 0: no number of concepts would separate them, and the answer says so.
    assert few.verdicts.concepts_needed is None
    assert any(s.startswith("No number of concepts would separate all of them") for s in few.sentences)


def test_one_strategy_better_by_five_points_leaves_the_other_worse(tmp_path):
    n = 17
    wiggle = np.resize([0.01, -0.01], n)
    answer = written_answer(tmp_path, {"A": base(n), "B": base(n) - 0.05 + wiggle}, {"A": 0.01})
    assert answer.best.strategy == "A" and verdict(answer, "B") == WORSE and answer.verdict == "separated"
    b = answer.verdicts.comparisons[0]
    assert b.mean_difference == pytest.approx(0.05 - wiggle.mean(), abs=1e-12)
    assert b.p_best_better == 1.0 and b.test == "Wilcoxon signed-rank, Holm"
    assert answer.verdicts.confidence_set == ("A",)
    # The printed answer is rendered from answer.json: change the file and the print follows it.
    text = answer_text(answer)
    assert "B L2: worse than the best (Wilcoxon signed-rank, Holm)" in text
    path = tmp_path / ANSWER_FILE
    doc = json.loads(path.read_text())
    doc["verdicts"]["comparisons"][0]["verdict"] = NOT_SEPARATED
    path.write_text(json.dumps(doc))
    assert "B L2: not separated (Wilcoxon signed-rank, Holm)" in answer_text(read_answer(path))


def test_the_best_is_chosen_on_cv_and_the_test_only_confirms_or_not():
    n = 8
    test = {"A": {f"c{i}": 0.8 for i in range(n)}, "B": {f"c{i}": 0.8 + 0.02 * (i + 1) for i in range(n)},
            "C": {f"c{i}": 0.6 + 0.001 * i for i in range(n)}}
    cv = {"A": {c: 0.9 for c in test["A"]}, "B": {c: 0.85 for c in test["B"]}, "C": {c: 0.7 for c in test["C"]}}
    layers = {"A": 1, "B": 2, "C": 3}
    compare = partial(compare_strategies, posterior_samples=2000, n_bootstrap=200)
    v = compare(test, cv, layers)
    # A wins on CV; B is ahead on every held-out concept (W = 0, exact p = 2/256), Holm over 2: 2 * 2/256 = 1/64.
    assert v.best.strategy == "A" and v.best.layer == 1 and v.best.test_top == "B"
    assert v.best.confirmation == CONTRADICTED
    b = next(c for c in v.comparisons if c.strategy == "B")
    assert b.wilcoxon_p == pytest.approx(2 / 256, rel=1e-12) and b.holm_p == pytest.approx(1 / 64, rel=1e-12)
    assert b.verdict == "better than the chosen best"
    test["B"] = {c: 0.8 + (0.03 if i % 2 else -0.025) for i, c in enumerate(test["B"])}  # ahead, not separably
    assert compare(test, cv, layers).best.confirmation == NOT_CONTRADICTED
    cv["B"] = {c: 0.95 for c in cv["B"]}
    chosen = compare(test, cv, layers).best
    assert chosen.strategy == "B" and chosen.confirmation == CONFIRMED
    assert choose_on_cv({"Z": 0.9, "Y": 0.9}) == "Y"  # a tie goes to the first name
    with pytest.raises(ProbeError, match="at least two concepts"):
        compare({"A": {"c": 0.8}, "B": {"c": 0.7}}, {"A": {"c": 0.8}, "B": {"c": 0.7}}, layers)


def test_wilcoxon_with_holm_by_hand():
    # Seven concepts. B is below A on every one by distinct amounts: W = 0, exact p = 2 / 2^7 = 0.015625.
    # C alternates: |d| ranks 1..7, W+ = 1 + 3 + 5 + 7 = 16, W- = 12: p by enumerating the 128 sign patterns.
    n = 7
    d_b = 0.03 + 0.001 * np.arange(n)
    d_c = np.array([0.020, -0.021, 0.022, -0.023, 0.024, -0.025, 0.026])
    a = base(n)
    test = {"A": dict(zip(map(str, range(n)), a, strict=True)),
            "B": dict(zip(map(str, range(n)), a - d_b, strict=True)),
            "C": dict(zip(map(str, range(n)), a - d_c, strict=True))}
    cv = {s: {c: v + (0.05 if s == "A" else 0.0) for c, v in by.items()} for s, by in test.items()}
    v = compare_strategies(test, cv, {"A": 0, "B": 0, "C": 0})
    b, c = (next(x for x in v.comparisons if x.strategy == s) for s in ("B", "C"))
    p_c = exact_wilcoxon_p(d_c)
    assert b.wilcoxon_statistic == 0.0 and b.wilcoxon_p == pytest.approx(2 / 128, rel=1e-12)
    assert c.wilcoxon_statistic == 12.0 and c.wilcoxon_p == pytest.approx(p_c, rel=1e-12)
    # Holm: the smaller p times 2, the larger one times 1 (never below the step before).
    assert b.holm_p == pytest.approx(2 * 2 / 128, rel=1e-12) and c.holm_p == pytest.approx(max(p_c, 4 / 128))
    assert (b.verdict, c.verdict) == (WORSE, NOT_SEPARATED)


def test_holm_twin_equals_statsmodels_and_a_hand_computation():
    """holm_adjusted is kept because statsmodels' multipletests collects garbage on every call; it must give
    multipletests' adjusted p exactly, ties, caps at 1 and single tests included."""
    from statsmodels.stats.multitest import multipletests

    # By hand: sorted 0.01, 0.02, 0.03, 0.5 times 4, 3, 2, 1 -> 0.04, 0.06, 0.06, 0.5 (running max), unsorted.
    assert holm_adjusted([0.5, 0.01, 0.03, 0.02]).tolist() == pytest.approx([0.5, 0.04, 0.06, 0.06], abs=1e-15)
    rng = np.random.default_rng(7)
    cases = [rng.uniform(0, 1, 18), rng.uniform(0, 0.1, 18), np.array([0.3]), np.array([0.02, 0.02, 0.9, 1.0]),
             np.round(rng.uniform(0, 0.2, 40), 2), np.ones(5)]
    for p in cases:
        assert np.array_equal(holm_adjusted(p), multipletests(p, alpha=0.05, method="holm")[1])
    # A twin that forgot the running maximum would pass the hand case's first entries, not this one.
    assert holm_adjusted([0.011, 0.012])[1] == pytest.approx(0.022) and holm_adjusted([0.011, 0.012])[0] == 0.022


@pytest.mark.parametrize("n", [2, 5])
def test_bayesian_signed_rank_against_a_hand_computation(n):
    # Every difference 0.05 (beyond the ±0.01 ROPE): every pair of the n differences and the prior's
    # pseudo-difference 0 sums above 2 x ROPE except the prior with itself, whose mass is w0^2 with
    # w0 ~ Beta(0.5, n) (the Dirichlet weight of the prior, 0.5 against n ones). So the ROPE region holds the
    # most mass exactly when w0^2 > 1 - w0^2, i.e. w0 > 1/sqrt(2): P(ROPE wins) = 1 - I_{1/sqrt 2}(0.5, n).
    best, other = np.full(n, 0.85), np.full(n, 0.80)
    p_best, p_rope, p_other = bayesian_signed_rank(best, other, 0.01, nsamples=SAMPLES, seed=3)
    want = float(beta.sf(1 / math.sqrt(2), 0.5, n))
    assert p_rope == pytest.approx(want, abs=mc_tolerance(want))
    assert p_other == 0.0 and p_best == pytest.approx(1.0 - p_rope, abs=1e-12)
    # Differences all inside the ROPE: every pair sum is inside 2 x ROPE, so the ROPE always wins.
    assert bayesian_signed_rank(best, best - 0.004, 0.01, nsamples=2000) == (0.0, 1.0, 0.0)


def test_concepts_to_separate_is_the_smallest_n_with_the_power_by_hand():
    d = np.array([0.02, 0.0, 0.01, 0.03, 0.015, 0.005])  # mean 0.0133, sd 0.0108
    alpha = 0.05 / 5
    n = concepts_to_separate(d, alpha)
    effect = d.mean() / d.std(ddof=1)

    def power(m: int) -> float:  # the paired t-test's power from the noncentral t, two-sided
        crit = student_t.ppf(1 - alpha / 2, m - 1)
        nc = effect * math.sqrt(m)
        return float(nct.sf(crit, m - 1, nc) + nct.cdf(-crit, m - 1, nc))

    assert n is not None and power(n) >= 0.8 > power(n - 1)
    assert concepts_to_separate(np.array([0.01, -0.01]), alpha) is None  # mean 0: no number would do


def test_concepts_to_separate_survives_scipys_nan_in_the_far_tail():
    """The 17 per-concept D1_mix differences of a real contenders run (LA2 minus A4, effect 0.84, already separated
    by Wilcoxon-Holm at 17): scipy's nct.cdf is NaN in the lower tail at the search's upper bound (60 concepts),
    which read as "not enough" and gave 100,000. The answer is 20 (power 0.80 there, 0.77 at 19)."""
    d = np.array([0.07678571, 0.00119048, -0.01785714, 0.1672619, -0.02440476, 0.01428571, -0.01547619, 0.06785714,
                  0.01666667, 0.03809524, 0.05714286, 0.05238095, 0.06904762, 0.00892857, 0.08035714, 0.04345238,
                  0.03690476])
    alpha = 0.05 / 5
    effect = d.mean() / d.std(ddof=1)
    assert math.isnan(nct.cdf(-student_t.ppf(1 - alpha / 2, 59), 59, effect * math.sqrt(60)))  # scipy's NaN
    upper = [float(nct.sf(student_t.ppf(1 - alpha / 2, m - 1), m - 1, effect * math.sqrt(m))) for m in (19, 20)]
    assert upper[0] < 0.8 <= upper[1]  # the lower tail is below 1e-9 at both
    assert concepts_to_separate(d, alpha) == 20


def test_rank_intervals_over_concepts_by_hand():
    # A is first on every concept: every resample ranks it 1; C last on every concept: always 3.
    scores = np.array([[0.9, 0.8, 0.5], [0.9, 0.85, 0.6], [0.95, 0.9, 0.7]])
    low, high = rank_intervals(scores, n_bootstrap=200, seed=0)
    assert list(low) == [1, 2, 3] and list(high) == [1, 2, 3]


def test_added_sections_travel_through_answer_json(tmp_path):
    answer = written_answer(tmp_path, equal_pair(6))
    section = AnswerSection("steerability", "Does the best probe steer best?", ("Spearman 0.41 [0.10, 0.66].",),
                            {"spearman": 0.41, "low": 0.10, "high": 0.66, "n": 19})
    path = tmp_path / "with_section.json"
    write_answer(replace(answer, sections=(section,)), path)
    back = read_answer(path)
    assert back.sections == (section,)
    assert answer_text(back).endswith("Does the best probe steer best?\nSpearman 0.41 [0.10, 0.66].")


def scored(concept: str, strategy: str, scores: list[float]) -> pa.Table:
    """Four matched pairs of one concept: passages p{i}+ and p{i}- share pair g{i}."""
    ids = [f"{concept}-p{i}{sign}" for i in range(4) for sign in "+-"]
    return cell_scores_table(concept, 2, strategy, "logistic", HELDOUT, np.array(ids),
                             np.array([i.rsplit("p", 1)[0] + i[-2] for i in ids]), np.tile([1, 0], 4),
                             np.array(scores))


def test_paired_bootstrap_over_matched_pairs_on_these_concepts(tmp_path):
    # Concept x: A ranks every positive above every negative (AUROC 1); B swaps one pair's scores, so one
    # positive (0.2) sits below three negatives (0.3, 0.5, 0.7): AUROC 1 - 3/16 = 0.8125. Concept y: A and B
    # score alike (difference 0). The mean over the two concepts: (0.1875 + 0) / 2 = 0.09375.
    a_x = [0.9, 0.1, 0.8, 0.3, 0.6, 0.5, 0.95, 0.7]
    b_x = [0.9, 0.1, 0.2, 0.3, 0.6, 0.5, 0.95, 0.7]
    y = [0.9, 0.1, 0.8, 0.3, 0.2, 0.5, 0.95, 0.7]
    table = concat_scores([scored("x", "A", a_x), scored("x", "B", b_x), scored("y", "A", y), scored("y", "B", y)])
    cells = held_out_cells(table, {"A": 2, "B": 2}, "logistic")
    result = pairs_bootstrap([cells[("x", "A")], cells[("y", "A")]], [cells[("x", "B")], cells[("y", "B")]],
                             n_bootstrap=500, seed=0)
    assert result.difference == pytest.approx(0.09375, abs=1e-15) and result.n_pairs == 8
    assert result.low >= 0.0 and result.high <= 0.5  # no resample puts B ahead; at most a whole concept's 1
    same = pairs_bootstrap([cells[("y", "A")]], [cells[("y", "B")]], n_bootstrap=100)
    assert (same.difference, same.low, same.high, same.p_value) == (0.0, 0.0, 0.0, 1.0)
    # Through the answer-writing path: the run's table reaches the answer, labelled "on these concepts".
    outcome = run_of({"A": np.array([1.0, 0.875]), "B": np.array([0.8125, 0.875])}, {"A": 0.01})
    outcome.passage_scores = table.set_column(0, "concept", pa.array(["c000"] * 16 + ["c001"] * 16))
    answer = read_answer(write_run_outputs(outcome, tmp_path, stamp="s")["answer"])
    pairs = answer.verdicts.comparisons[0].pairs
    assert pairs is not None and pairs.difference == pytest.approx(0.09375, abs=1e-15)
    assert any(s.startswith("On these concepts (a paired bootstrap over matched pairs") for s in answer.sentences)


def test_findings_report_and_printed_leaderboard_render_answer_json(tmp_path):
    """The run folder's answer.json is the one source: edit it, and the findings page, the report and the printed
    leaderboard show the edit (nothing recomputes the answer from the documents)."""
    from rich.console import Console

    from poolbench.cli.board import leaderboard_table
    from poolbench.results.pages.findings import write_findings
    from poolbench.results.pages.report import render_report
    from poolbench.results.pages.report_runs import load_runs

    n = 17
    paths = write_run_outputs(run_of({"A": base(n), "B": base(n) - 0.05 + np.resize([0.01, -0.01], n)},
                                     {"A": 0.01}), tmp_path / "run", stamp="s")
    doc = json.loads(paths["answer"].read_text())
    doc["sentences"][0] = "The edited first sentence."
    doc["verdicts"]["comparisons"][0]["verdict"] = EQUIVALENT
    paths["answer"].write_text(json.dumps(doc))
    page = write_findings(tmp_path / "run", tmp_path / "docs")[0].read_text()
    assert "- The edited first sentence." in page and f"| B | 2 | {EQUIVALENT} |" in page
    html, _ = render_report(load_runs(tmp_path / "run"))
    assert "<p>The edited first sentence.</p>" in html and f"<td>B</td><td>2</td><td>{EQUIVALENT}</td>" in html
    console = Console(record=True, width=250, force_terminal=False)
    console.print(leaderboard_table(json.loads(paths["leaderboard"].read_text()), read_answer(paths["answer"])))
    assert EQUIVALENT in next(line for line in console.export_text().splitlines() if " B " in line)
