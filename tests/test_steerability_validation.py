"""`make run-steerability`'s verdict on constructed cells (pass, fail, D2 not run), and the whole validation on the
tiny Llama: pooled with gradient sums, exact shift and D2 through the transformers backend with stand-in scorers,
the record stored for later runs' answers and the findings page written from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from word_scorer import WordScorer

from poolbench.steerer.steerability_check import ValidationCell, steerability_verdict

STRATEGIES = ("A1_mean", "A4_norm_weighted", "P1_last", "S2_gradient")


def few_pairs(passages, train: int = 6, test: int = 3):
    """The first `train` and `test` matched pairs of each split: enough for a DiffMean vector and a contrast."""
    keep: dict[str, list[str]] = {"train": [], "test": []}
    for p in passages:
        if p.group not in keep[p.split] and len(keep[p.split]) < {"train": train, "test": test}[p.split]:
            keep[p.split].append(p.group)
    return [p for p in passages if p.group in keep[p.split]]


def cells(exact_sign: float, d2_sign: float | None) -> list[ValidationCell]:
    out = []
    for concept in ("p", "q", "r"):
        for i, s in enumerate(STRATEGIES):
            first = float(i + 1)
            out.append(ValidationCell(concept, s, 3, first, exact_sign * first,
                                      None if d2_sign is None else d2_sign * first, None))
    out.append(ValidationCell("p", "S3_iti_probe", 3, None, None, null_reason="no pooled vector"))
    return out


def test_the_verdict_passes_when_every_measure_ranks_alike():
    v = steerability_verdict(cells(1.0, 1.0), 0.1)
    assert v.n_cells == 13
    assert v.exact.mean_rho == 1.0 and v.d2 is not None and v.d2.mean_rho == 1.0
    assert v.tracks_exact and v.tracks_d2 and v.stands_in
    assert "may stand in for D2" in v.sentence()


def test_should_fail_d2_reversed_is_not_a_stand_in():
    v = steerability_verdict(cells(1.0, -1.0), 0.1)
    assert v.tracks_exact and v.tracks_d2 is False and not v.stands_in
    assert "may NOT stand in for D2" in v.sentence()
    bad = steerability_verdict(cells(-1.0, 1.0), 0.1)
    assert bad.exact.mean_rho == -1.0 and not bad.tracks_exact and not bad.stands_in


def test_without_d2_it_is_not_validated_as_a_stand_in():
    v = steerability_verdict(cells(1.0, None), 0.1)
    assert v.d2 is None and v.tracks_d2 is None and not v.stands_in
    assert "D2 did not run" in v.sentence()


@pytest.mark.slow  # 80-115 s on the loaded 2-core machine: pooling, exact scoring and D2 on 12 cells
@pytest.mark.numerics
def test_the_validation_runs_on_the_tiny_model_and_its_page_and_record_follow(layered_llama_dir, tmp_path):
    from poolbench.corpus.corpus_versions import generate_embedded_corpus
    from poolbench.corpus.layout import write_corpus
    from poolbench.driver.steerability_stage import validation_key
    from poolbench.driver.steerability_validation import ValidationSettings, run_validation
    from poolbench.extractor.loading import load_model
    from poolbench.results.pages.steerability_page import steerability_page
    from poolbench.steerer.worker import SteeringWorker
    from poolbench.store.url import open_store

    generated = generate_embedded_corpus("tiny")
    concepts = sorted(generated)[:3]
    root = tmp_path / "corpus"
    write_corpus(root, {c: few_pairs(generated[c]) for c in concepts})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat on\nnear the river\n")
    worker = SteeringWorker(load_model(str(layered_llama_dir), device="cpu"))
    settings = ValidationSettings(alpha=0.1, layer=1, strategies=STRATEGIES, backend="transformers",
                                  n_prompts=None, prompts_file=str(prompts), d2_alphas=(0.0, 0.4), max_new_tokens=3)
    lines: list[str] = []
    run = run_validation("tiny", str(root), "small", f"file://{tmp_path / 'store'}", settings, lines.append,
                         worker=worker, scorers={c: WordScorer(c, "e") for c in concepts})
    assert run.concepts == tuple(concepts) and len(run.cells) == 3 * len(STRATEGIES)
    live = [c for c in run.cells if c.first_order is not None]
    assert len(live) == len(run.cells) and all(c.exact is not None and c.d2_delta is not None for c in live)
    # the linearisation on a 3-layer model at alpha = 0.1: exact and first order share their sign on every cell
    # whose first-order term is not tiny (the test asserts the measure, not a threshold tuned to pass)
    big = [c for c in live if abs(c.first_order) > 0.1 * max(abs(x.first_order) for x in live)]
    assert all(np.sign(c.exact) == np.sign(c.first_order) for c in big)
    record = run.to_record()
    assert record["verdict"]["exact"]["n_concepts"] == 3 and record["seconds"]["total_s"] > 0
    page = steerability_page(record)
    assert run.verdict.sentence() in page and page.count("| ") > 18
    assert record["scorer_auroc"] == dict.fromkeys(concepts, 1.0) and "Where the time goes" in page
    open_store(f"file://{tmp_path / 'store'}").put_json(validation_key(run.weights_hash), record)
    assert open_store(f"file://{tmp_path / 'store'}").get_json(validation_key(run.weights_hash))["verdict"][
        "sentence"] == run.verdict.sentence()
    assert Path(root).exists() and lines
    # a rerun (as after a kill) reads every concept's cells and every D2 cell back from the store
    again: list[str] = []
    rerun = run_validation("tiny", str(root), "small", f"file://{tmp_path / 'store'}", settings, again.append,
                           worker=worker, scorers={c: WordScorer(c, "e") for c in concepts})
    assert [c.to_record() for c in rerun.cells] == [c.to_record() for c in run.cells]
    assert sum("read back from the store" in line for line in again) == 3
    # a budget spent after the first concept starts no other; the page says the run was cut short
    cut = run_validation("tiny", str(root), "small", f"file://{tmp_path / 'store'}",
                         dataclasses.replace(settings, budget_s=0.0), again.append, worker=worker,
                         scorers={c: WordScorer(c, "e") for c in concepts})
    assert cut.concepts == tuple(concepts[:1]) and {c.concept for c in cut.cells} == {concepts[0]}
    assert "Cut short by its time budget: 1 of the 3 planned concepts ran" in steerability_page(cut.to_record())


def test_a_concepts_interval_brackets_its_spearman_and_is_a_point_when_ranks_agree_exactly():
    from scipy.stats import spearmanr

    from poolbench.steerer.steerability_check import concept_rho_interval

    names = [f"s{i}" for i in range(19)]
    first = {s: float(i) for i, s in enumerate(names)}
    assert concept_rho_interval(first, {s: 2.0 * v + 1 for s, v in first.items()}) == (1.0, 1.0)
    assert concept_rho_interval(first, {s: -v for s, v in first.items()}) == (-1.0, -1.0)
    noisy = {s: v + float(np.random.default_rng(3).normal(0, 6, 19)[i]) for i, (s, v) in enumerate(first.items())}
    low, high = concept_rho_interval(first, noisy)
    rho = spearmanr(list(first.values()), list(noisy.values())).statistic
    assert -1 <= low < rho < high <= 1
    assert concept_rho_interval(first, dict.fromkeys(names, 1.0)) is None  # a constant measure has no Spearman
    assert concept_rho_interval({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0}) is None  # below 3 strategies
