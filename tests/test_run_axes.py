"""The run's cell axes beside layers (issue 44): activation sites and context lengths.

Sites: mean pooling is linear, so on a pre-norm block the pooled block output equals the pooled block input plus
the pooled attention and MLP sub-block outputs; each site pooled by its own capture (pool_concept_tables(site=))
pins the run's site wiring to the right tensors (a wrong module breaks the sum by O(1)). Tolerance: each pooled
vector is a mean of T float32 tokens, three of them summed (tests/tolerances.py, terms = 3·T).

Length: the constructed corpus of tests/test_long_context.py (one +6 token among n unit normals; positives only)
through the results' length section: mean pooling loses D1 at 4x (d' 2.12 -> 1.06: AUROC 0.93 -> 0.77, a drop of
~0.16 per concept), max pooling does not (the token stays the max: AUROC > 0.99 at both lengths)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_long_context import _pooled
from tolerances import assert_float32_close

from poolbench.config import RunConfig
from poolbench.corpus.long_context import in_context
from poolbench.corpus.passage import Passage
from poolbench.driver.variants import MAIN, Variant, axis_variants
from poolbench.extractor.loading import load_model
from poolbench.pooler.concept_pooling import pool_concept_tables
from poolbench.pooler.pooled_table import decode_vectors
from poolbench.pooler.registry import resolve_strategies
from poolbench.prober.d1 import evaluate_d1
from poolbench.records.d1 import D1CellRecord
from poolbench.records.verdicts import WORSE
from poolbench.results.answer.axes import answer_sections, length_section, site_section

TEXTS = ("The kids ran home after the long game.", "It might rain later, I suppose.",
         "Prices rose sharply in the spring.", "Nobody answered the door that night at all.")


def _passages() -> list[Passage]:
    return [Passage(f"p{i}", text, i % 2, "d", len(text.split()), f"g{i // 2}", "train", "c")
            for i, text in enumerate(TEXTS)]


def test_pooled_sites_add_up_to_the_block_output_on_the_tiny_model(layered_llama_dir) -> None:
    loaded = load_model(str(layered_llama_dir))
    specs = resolve_strategies(["A1_mean"])
    pooled = {}
    for site in ("residual", "attn", "mlp"):
        table = pool_concept_tables(loaded, _passages(), [0, 1], specs, batch_size=4, site=site).pooled
        layer = table.column("layer").to_numpy()
        vectors = decode_vectors(table)
        pooled[site] = {int(L): vectors[layer == L] for L in (0, 1)}
    tokens = max(len(loaded.tokenizer(t)["input_ids"]) for t in TEXTS)
    before, total = pooled["residual"][0], pooled["residual"][0] + pooled["attn"][1] + pooled["mlp"][1]
    scale = float(max(np.abs(before).max(), np.abs(pooled["residual"][1]).max()))
    assert_float32_close(pooled["residual"][1], total, terms=3 * tokens, scale=scale, err_msg="layer 1")
    assert np.abs(pooled["attn"][1] - pooled["mlp"][1]).max() > 1e-3  # two different tensors
    assert np.abs(pooled["residual"][1] - pooled["residual"][0]).max() > 1e-3  # the block moves the stream


def test_variants_keep_the_main_keys_and_lengthen_only_test_passages() -> None:
    cfg = RunConfig(sites=("residual", "attn", "mlp"), context_lengths=(4, 1))
    assert cfg.context_lengths == (1, 4)
    assert axis_variants(cfg) == [Variant(site="attn"), Variant(site="mlp"), Variant(context_length=4)]
    assert MAIN.key_fields() == {} and Variant("attn").key_fields() == {"site": "attn"}
    assert Variant(context_length=4).key_fields() == {"context_length": 4} and Variant(context_length=4).name == "k4"
    test = Passage("t1", "It might rain, I suppose.", 1, "d", 6, "g1", "test", "c")
    train = Passage("t0", "It will rain.", 1, "d", 4, "g0", "train", "c")
    assert Variant(context_length=4).passages([train, test], 0) == [train, in_context(test, 4, 0)]
    assert Variant(context_length=4).max_length(256) == 1024
    with pytest.raises(ValueError, match="must include residual"):
        RunConfig(sites=("attn",))
    with pytest.raises(ValueError, match="1 included"):
        RunConfig(context_lengths=(4,))


def _cell(concept: str, strategy: str, auroc: float, k: int | None = None, site: str | None = None,
          layer: int = 0, cv: float | None = None) -> D1CellRecord:
    return D1CellRecord(concept=concept, layer=layer, strategy=strategy, probe="logistic",
                        cv_auroc=auroc if cv is None else cv, test_auroc=auroc, ci_low=max(0.0, auroc - 0.05),
                        ci_high=min(1.0, auroc + 0.05), context_length=k, site=site)


def test_mean_pooling_loses_d1_with_length_and_max_pooling_does_not_in_the_length_section() -> None:
    main, longer = [], []
    for c in range(4):
        rng = np.random.default_rng(c)
        train, y_train = _pooled(40, 8, rng)
        groups = np.repeat(np.arange(40), 2)
        for k in (1, 4):
            test, y_test = _pooled(40, 8 * k, rng)
            for pooling, strategy in (("mean", "A1_mean"), ("max", "A2_max")):
                auroc = evaluate_d1(train[pooling], y_train, groups, test[pooling], y_test, groups, n_folds=5,
                                    seed=0, n_bootstrap=10)["logistic"].test_auroc
                (main if k == 1 else longer).append(_cell(f"c{c}", strategy, auroc, None if k == 1 else k))
    section = length_section(main, longer, rope=0.05)["context_lengths"]
    assert section["lengths"] == [1, 4]
    mean, peak = section["by_strategy"]["A1_mean"], section["by_strategy"]["A2_max"]
    assert mean["reading"]["4"] == "loses" and mean["change"]["4"]["high"] < -0.05
    assert peak["reading"]["4"] == "keeps" and peak["d1"]["4"]["mean"] > 0.95
    [words] = answer_sections({"context_lengths": {**section}})
    assert "loses: A1_mean" in words.sentences[1] and "keeps: A2_max" in words.sentences[1]


def test_the_site_section_compares_each_sites_cv_chosen_best_with_the_answers_verdicts() -> None:
    concepts = [f"c{i}" for i in range(8)]
    main = [_cell(c, s, a + 0.01 * i) for i, c in enumerate(concepts) for s, a in (("A1_mean", 0.70), ("P1_last", 0.6))]
    attn = [_cell(c, s, a + 0.01 * i, site="attn", k=1, layer=L) for i, c in enumerate(concepts)
            for s, a, L in (("A1_mean", 0.90, 1), ("A1_mean", 0.80, 0), ("P1_last", 0.65, 0))]
    section = site_section(main, attn, n_bootstrap=200)["sites"]
    assert section["sites"] == ["residual", "attn"] and section["best_on_cv"] == "attn"
    assert section["best_by_site"]["attn"] == {"strategy": "A1_mean", "layer": 1, "mean_cv_auroc": pytest.approx(
        0.935), "d1": {"mean": pytest.approx(0.935), "low": pytest.approx(0.935 - 2.3646 * 0.024495 / np.sqrt(8),
                                                                          abs=1e-4),
                       "high": pytest.approx(0.935 + 2.3646 * 0.024495 / np.sqrt(8), abs=1e-4), "n": 8}}
    [residual] = section["verdicts"]["comparisons"]
    # every concept 0.20 lower at the residual site: Wilcoxon's exact p over 8 concepts is 2/2^8 (one comparison)
    assert residual["strategy"] == "residual" and residual["verdict"] == WORSE
    assert residual["mean_difference"] == pytest.approx(0.2) and residual["holm_p"] == pytest.approx(2 / 256)
    sentences = answer_sections({"sites": section})[0].sentences
    assert sentences[0].startswith("Best activation site, chosen on the training CV: attn (A1_mean at layer 1")
    assert "not steered" in sentences[-1]


@pytest.mark.slow
def test_a_run_with_three_sites_and_two_lengths_keeps_the_residual_cells(tiny_llama_dir, local_ray, cache,
                                                                         tmp_path) -> None:
    from poolbench.driver.pipeline import run_benchmark
    from poolbench.results.documents.document import write_run_outputs
    from poolbench.results.pages.report import write_report

    base = dict(model=str(tiny_llama_dir), corpus="embedded-v1", corpus_size="tiny", concepts=("hedging", "toxicity"),
                strategies=("A1_mean", "A2_max", "P1_last"), store=str(tmp_path / "store"), n_bootstrap=50,
                torch_threads=1, steering=False, reliability=False)
    alone = run_benchmark(RunConfig(**base))
    both = run_benchmark(RunConfig(**base, sites=("residual", "attn", "mlp"), context_lengths=(1, 4)))
    assert both.computed["pooled_skipped"] == 2 and both.computed["d1_skipped"] == 2  # the main keys are unchanged
    assert both.computed["pooled_attn"] == both.computed["pooled_mlp"] == both.computed["pooled_k4"] == 2
    assert [r.to_dict() for r in both.records] == [r.to_dict() for r in alone.records]
    n = len(alone.records)
    by = {(r.site, r.context_length): [] for r in both.axis_records}
    for r in both.axis_records:
        by[(r.site, r.context_length)].append(r)
    assert {key: len(cells) for key, cells in by.items()} == {("attn", 1): n, ("mlp", 1): n, ("residual", 4): n}
    assert len(alone.records) + sum(len(v) for k, v in by.items() if k[1] == 1) == 3 * n  # 3 sites: 3x the cells
    # at length 4 the training split is pooled again in its own forwards: its CV equals length 1's to rounding
    cv1 = {(r.concept, r.layer, r.strategy, r.probe): r.cv_auroc for r in alone.records}
    for r in by[("residual", 4)]:
        assert r.cv_auroc == pytest.approx(cv1[(r.concept, r.layer, r.strategy, r.probe)], abs=0.02)
        assert r.n_test == next(a.n_test for a in alone.records if a.concept == r.concept)
    out = tmp_path / "run"
    out.mkdir()
    paths = write_run_outputs(both, out)
    results = json.loads(paths["results"].read_text())
    board = json.loads(paths["leaderboard"].read_text())
    assert len(results["cells"]) == n and len(results["axes"]["cells"]) == 3 * n
    assert {c["site"] for c in results["axes"]["cells"]} == {"attn", "mlp", "residual"}
    assert results["config"]["sites"] == ["residual", "attn", "mlp"] and "not steered" in results["axes"]["steering"]
    assert board["sites"]["sites"] == ["residual", "attn", "mlp"] and board["context_lengths"]["lengths"] == [1, 4]
    assert set(board["sites"]["by_site"]["mlp"]) == {"A1_mean", "A2_max", "P1_last"}
    answer = json.loads(paths["answer"].read_text())
    assert [s["key"] for s in answer["sections"]] == ["sites", "context_lengths"]
    write_report(out, out / "report.html", store=str(tmp_path / "store"))
    page = (out / "report.html").read_text()
    assert "D1 by activation site and context length" in page and "change at 4x" in page
