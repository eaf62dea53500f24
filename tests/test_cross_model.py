"""The cross-model table from hand-built leaderboards: means, ranks, relative depth, equal means said as such, and
each model's own verdicts (its answer.json) within it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from poolbench.errors import PoolBenchError
from poolbench.records.verdicts import EQUIVALENT, NOT_SEPARATED, WORSE
from poolbench.results.answer.cross_model import ModelBoard, cross_model_table, not_separated_from_best, relative_depth


def board(name: str, n_layers: int, d1: dict[str, list[float]], layers: dict[str, int]) -> ModelBoard:
    concepts = [f"c{i}" for i in range(len(next(iter(d1.values()))))]
    rows = [{"strategy": s, "family": "uniform", "best_layer": layers[s],
             "layer_curve": {str(L): 0.5 + 0.01 * L for L in range(n_layers)},
             "per_concept": {c: {"auroc": v} for c, v in zip(concepts, values, strict=True)}}
            for s, values in d1.items()]
    return ModelBoard(name, f"org/{name}", n_layers, {"strategies": rows}, folder=f"models/{name}")


def test_relative_depth() -> None:
    assert relative_depth(0, 30) == 0.0 and relative_depth(29, 30) == 1.0 and relative_depth(9, 19) == 0.5
    assert relative_depth(0, 1) == 0.0


def test_same_winner_in_both_models_is_said_once_with_w_one() -> None:
    a = board("small", 30, {"A": [0.9, 0.8, 0.85], "B": [0.7, 0.7, 0.7], "C": [0.6, 0.5, 0.55]},
              {"A": 15, "B": 29, "C": 0})
    b = board("gemma", 18, {"A": [0.95, 0.9, 0.9], "B": [0.8, 0.75, 0.7], "C": [0.5, 0.6, 0.5]},
              {"A": 17, "B": 3, "C": 9})
    table = cross_model_table([a, b], n_permutations=99, n_bootstrap=50)
    assert table["strategies"] == ["A", "B", "C"]
    top = table["rows"][0]
    assert top["per_model"]["small"]["mean_d1"] == pytest.approx(0.85)
    assert top["per_model"]["gemma"]["mean_d1"] == pytest.approx(2.75 / 3)
    assert top["per_model"]["small"]["relative_depth"] == pytest.approx(15 / 29)
    assert top["per_model"]["gemma"]["relative_depth"] == 1.0
    # t-interval over 3 concepts: mean 0.85, sd 0.05, t(0.975, 2) = 4.3027 -> half-width 0.1242.
    assert top["per_model"]["small"]["ci_low"] == pytest.approx(0.85 - 4.302653 * 0.05 / 3 ** 0.5, abs=1e-5)
    assert table["agreement"]["kendall_w"] == pytest.approx(1.0)
    assert table["best"] == {"per_model": {"small": ["A"], "gemma": ["A"]}, "in_every_model": ["A"],
                             "on_average": ["A"], "on_average_mean_rank": 1.0,
                             "chosen_on_cv": {}, "not_separated_within_model": {}}
    assert table["answer"][0] == "A is the best strategy in every model (small (org/small) and gemma (org/gemma))."
    assert table["answer"][1] == "small (org/small)'s best, A, is also best on gemma (org/gemma)."
    assert "Kendall's W = 1.00" in table["answer"][3]


def test_different_winners_and_tied_average_are_said_as_such() -> None:
    a = board("m1", 4, {"A": [0.9, 0.9], "B": [0.8, 0.8], "C": [0.5, 0.5]}, dict.fromkeys("ABC", 1))
    b = board("m2", 4, {"A": [0.8, 0.8], "B": [0.9, 0.9], "C": [0.5, 0.5]}, dict.fromkeys("ABC", 2))
    table = cross_model_table([a, b], n_permutations=99, n_bootstrap=50)
    assert table["best"]["per_model"] == {"m1": ["A"], "m2": ["B"]}
    assert table["best"]["in_every_model"] == []
    assert table["best"]["on_average"] == ["A", "B"]  # mean rank 1.5 each: a tie, not A by name order
    assert table["answer"][0].startswith("No strategy is best in every model: best on m1 (org/m1) is A")
    assert table["answer"][1] == ("m1 (org/m1)'s best, A, is not best on m2 (org/m2): rank 2 of 3, D1 0.800 "
                                  "against B's 0.900; no verdict (that model's folder holds no answer).")
    assert "A and B (equal mean ranks), mean rank 1.5 of 3" in table["answer"][2]
    # ranks (1,2,3) and (2,1,3): W = (1 + rho)/2 with rho = 0.5 -> 0.75
    assert table["agreement"]["kendall_w"] == pytest.approx(0.75)


def test_tie_inside_one_model_is_named() -> None:
    a = board("m1", 4, {"A": [0.9, 0.9], "B": [0.9, 0.9], "C": [0.5, 0.5]}, dict.fromkeys("ABC", 1))
    b = board("m2", 4, {"A": [0.9, 0.9], "B": [0.8, 0.8], "C": [0.5, 0.5]}, dict.fromkeys("ABC", 1))
    table = cross_model_table([a, b], n_permutations=99, n_bootstrap=50)
    assert table["best"]["in_every_model"] == ["A"]
    assert table["answer"][0] == "A is best in every model, with equal means: on m1 (org/m1) A and B."
    assert table["rows"][0]["per_model"]["m1"]["rank"] == 1.5


def test_only_shared_strategies_and_concepts_enter_and_one_model_is_refused() -> None:
    a = board("m1", 4, {"A": [0.9, 0.8], "B": [0.7, 0.6], "X": [0.5, 0.5]}, dict.fromkeys("ABX", 1))
    b = board("m2", 4, {"A": [0.9], "B": [0.7]}, dict.fromkeys("AB", 1))
    table = cross_model_table([a, b], n_permutations=99, n_bootstrap=50)
    assert table["strategies"] == ["A", "B"] and table["concepts"] == ["c0"]
    assert table["rows"][0]["per_model"]["m1"]["mean_d1"] == pytest.approx(0.9)  # c1 left out: m2 lacks it
    with pytest.raises(PoolBenchError, match="at least two models"):
        cross_model_table([a])


def test_within_a_model_the_verdicts_come_from_its_own_answer() -> None:
    a = board("m1", 4, {"A": [0.9, 0.9], "B": [0.8, 0.8], "C": [0.5, 0.5]}, dict.fromkeys("ABC", 1))
    b = board("m2", 4, {"A": [0.9, 0.9], "B": [0.8, 0.8], "C": [0.5, 0.5]}, dict.fromkeys("ABC", 1))
    a = replace(a, chosen="A", verdicts={"B": NOT_SEPARATED, "C": WORSE})
    assert not_separated_from_best(a) == ["B"] and not_separated_from_best(b) is None
    table = cross_model_table([a, b], n_permutations=99, n_bootstrap=50)
    assert table["best"]["not_separated_within_model"] == {"m1": ["B"]}
    assert ("Within each model, its best chosen on CV is not separated (Wilcoxon-Holm or the ROPE, its own answer) "
            "from: on m1 (org/m1) 1 other strategy (best A).") in table["answer"]


def test_the_first_models_winner_is_placed_by_the_others_own_verdicts() -> None:
    """m1's best A is second on m2 and m3: not separated from m2's CV-chosen best by m2's answer, worse than m3's."""
    a = board("m1", 4, {"A": [0.9, 0.9], "B": [0.8, 0.8], "C": [0.5, 0.5]}, dict.fromkeys("ABC", 1))
    b = board("m2", 4, {"A": [0.8, 0.8], "B": [0.9, 0.9], "C": [0.5, 0.5]}, dict.fromkeys("ABC", 1))
    c = board("m3", 4, {"A": [0.8, 0.8], "B": [0.9, 0.9], "C": [0.5, 0.5]}, dict.fromkeys("ABC", 1))
    b = replace(b, chosen="B", verdicts={"A": EQUIVALENT, "C": WORSE})
    c = replace(c, chosen="B", verdicts={"A": WORSE, "C": WORSE})
    answer = cross_model_table([a, b, c], n_permutations=99, n_bootstrap=50)["answer"]
    assert answer[1:3] == [
        "m1 (org/m1)'s best, A, is not best on m2 (org/m2): rank 2 of 3, D1 0.800 against B's 0.900; not separated "
        "from that model's CV-chosen best, B, in its answer.",
        "m1 (org/m1)'s best, A, is not best on m3 (org/m3): rank 2 of 3, D1 0.800 against B's 0.900; worse than "
        "that model's CV-chosen best, B, in its answer."]


def test_a_tied_first_winner_is_not_carried_over() -> None:
    a = board("m1", 4, {"A": [0.9, 0.9], "B": [0.9, 0.9], "C": [0.5, 0.5]}, dict.fromkeys("ABC", 1))
    b = board("m2", 4, {"A": [0.8, 0.8], "B": [0.9, 0.9], "C": [0.5, 0.5]}, dict.fromkeys("ABC", 1))
    answer = cross_model_table([a, b], n_permutations=99, n_bootstrap=50)["answer"]
    assert not any("'s best," in line for line in answer)  # two winners on m1: no single one to follow


def test_d2_sits_beside_d1_for_a_model_that_steered() -> None:
    a = board("m1", 4, {"A": [0.9, 0.8], "B": [0.7, 0.6]}, dict.fromkeys("AB", 1))
    b = board("m2", 4, {"A": [0.9, 0.8], "B": [0.7, 0.6]}, dict.fromkeys("AB", 1))
    a.leaderboard["steering"] = {"A": {"mean_d2_delta": 0.12, "mean_scp": 0.4}}
    rows = {r["strategy"]: r for r in cross_model_table([a, b], n_permutations=99, n_bootstrap=50)["rows"]}
    assert (rows["A"]["per_model"]["m1"]["mean_d2_delta"], rows["A"]["per_model"]["m1"]["mean_scp"]) == (0.12, 0.4)
    assert "mean_d2_delta" not in rows["A"]["per_model"]["m2"] and "mean_d2_delta" not in rows["B"]["per_model"]["m1"]
