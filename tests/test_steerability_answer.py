"""The answer's steerability sentence, rendered from results.json's steerability section through build_answer:
the correlation with its interval, and what the validation on this model's weights allows it to claim."""

from __future__ import annotations

from poolbench.results.answer.answer import answer_text, build_answer
from poolbench.steerer.steerability_rank import steerability_agreement

D1 = {"a": 0.9, "b": 0.8, "c": 0.7}


def documents(validation: dict | None) -> tuple[dict, dict]:
    steer = {"p": {"a": 3.0, "b": 2.0, "c": 1.0}, "q": {"a": 3.0, "b": 2.0, "c": 1.0},
             "r": {"a": 1.0, "b": 2.0, "c": 3.0}}
    agreement = steerability_agreement({c: D1 for c in steer}, steer)
    rows = [{"strategy": s, "rank": i, "best_layer": 2, "mean_d1": v,
             "per_concept": {c: {"auroc": v} for c in steer}} for i, (s, v) in enumerate(D1.items(), start=1)]
    results = {"model": {"model_id": "m"},
               "steerability": {"agreement": agreement.to_record(), "cells": [], "validation": validation}}
    return results, {"probe": "logistic", "strategies": rows}


def test_the_answer_prints_the_correlation_and_says_it_is_unvalidated():
    answer = build_answer(*documents(None))
    assert answer.steerability is not None
    # per-concept rho: +1, +1, -1 -> mean 1/3; its interval is over the three concepts' resamples
    assert abs(answer.steerability.mean_rho - 1 / 3) < 1e-12
    assert answer.steerability.low is not None and answer.steerability.low <= 1 / 3 <= answer.steerability.high
    text = answer_text(answer)
    assert "Spearman(D1, first-order steerability) across strategies is +0.33 (3 concepts, 95% CI" in text
    assert "not validated against D2" in text


def test_should_fail_a_failed_validation_is_said():
    failed = {"stands_in": False, "sentence": "First-order steerability may NOT stand in for D2: ..."}
    text = answer_text(build_answer(*documents(failed)))
    assert "It may NOT stand in for D2 here" in text
    passed = answer_text(build_answer(*documents({"stands_in": True, "sentence": "ok"})))
    assert "may stand in for D2 on this model" in passed and "NOT" not in passed


def test_a_run_without_steerability_has_no_sentence():
    results, leaderboard = documents(None)
    del results["steerability"]
    answer = build_answer(results, leaderboard)
    assert answer.steerability is None and "first-order" not in answer_text(answer)
