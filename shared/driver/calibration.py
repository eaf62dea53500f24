"""`calibrate`: run the known-answer calibration concepts through the pipeline and check every expectation.

Each expectation is a gap between two held-out AUROCs (or one AUROC and chance) at one layer, with a 95% CI from
resampling matched pairs; it holds when the CI's lower end is above 0. Gaps on the same passages are paired
(one resample drives both strategies); gaps between two calibration concepts resample each independently.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from poolbench.config import RunConfig
from poolbench.corpus.calibration import CALIBRATION_STRATEGIES, EXPECTATIONS, Expectation, calibration_corpus_dir
from poolbench.errors import PoolBenchError

CI_LEVEL = 0.95
MAX_LENGTH = 1024
"""Calibration passages are about 80-170 tokens: a wide window so no tokenizer truncates a planted signal."""


def n_layers_of(model: str, model_args: dict[str, str]) -> int:
    """Decoder layers of a model reference, read from its config (no weights loaded)."""
    from transformers import AutoConfig

    from poolbench.extractor.loading import local_model_dir

    source = str(local_model_dir(model) or model)
    config = AutoConfig.from_pretrained(source, **model_args)
    n_layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(n_layers, int):
        raise PoolBenchError(f"model '{model}': its config names no num_hidden_layers")
    return n_layers


def held_out_scores(view, layer: int, strategy: str, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(test scores, test labels, test groups) of the logistic probe fitted on the train split."""
    from poolbench.prober.buckets import heldout_scores

    cell = view.matrix(layer, strategy)
    train, test = cell.subset("train"), cell.subset("test")
    return heldout_scores(train.X, train.y, test.X, seed), test.y, test.groups


def expectation_gap(expectation: Expectation, scores: dict[tuple[str, str], tuple], *, n_bootstrap: int,
                    seed: int) -> dict:
    """The expectation's AUROC gap and its CI; `scores` maps (concept, strategy) to held_out_scores."""
    from poolbench.prober.auroc import auroc, bootstrap_aurocs
    from poolbench.prober.significance import paired_bootstrap_auroc

    s_a, y_a, g_a = scores[(expectation.concept, expectation.strategy)]
    auroc_a = auroc(s_a, y_a)
    alpha = (1.0 - CI_LEVEL) / 2.0
    if expectation.versus_strategy is None:
        auroc_b = 0.5
        low, high = np.quantile(bootstrap_aurocs(s_a, y_a, g_a, n_bootstrap, seed) - 0.5, [alpha, 1 - alpha])
    elif expectation.versus_concept == expectation.concept:
        s_b, _, _ = scores[(expectation.concept, expectation.versus_strategy)]
        paired = paired_bootstrap_auroc(s_a, s_b, y_a, g_a, n_bootstrap=n_bootstrap, seed=seed, level=CI_LEVEL)
        auroc_b, low, high = paired.auroc_b, paired.ci_low, paired.ci_high
    else:
        assert expectation.versus_concept is not None
        s_b, y_b, g_b = scores[(expectation.versus_concept, expectation.versus_strategy)]
        auroc_b = auroc(s_b, y_b)
        diffs = bootstrap_aurocs(s_a, y_a, g_a, n_bootstrap, seed) - bootstrap_aurocs(s_b, y_b, g_b, n_bootstrap,
                                                                                         seed + 1)
        low, high = np.quantile(diffs, [alpha, 1 - alpha])
    gap = auroc_a - auroc_b
    return {"id": expectation.id, "statement": expectation.statement, "auroc": float(auroc_a),
            "versus_auroc": float(auroc_b), "gap": float(gap), "ci_low": float(low), "ci_high": float(high),
            "held": bool(low > 0.0)}


def run_calibration(model: str, *, layer: int | None = None, model_args: dict[str, str] | None = None,
                    dtype: str = "auto", device: str = "auto", store: str | None = None, batch_size: int = 32,
                    seed: int = 0, n_bootstrap: int = 1000,
                    on_event: Callable[[str, dict], None] | None = None) -> dict:
    """Pool the calibration concepts with W1, W2, P1 and A1 at one layer (default: the middle one) and report
    every expectation as held or not, with its AUROC gap and CI; `trained_only` ones a random-weight model fails."""
    from poolbench.driver.pipeline import run_benchmark
    from poolbench.pooler.pooled_table import PooledTableView, read_pooled_layer
    from poolbench.store.url import open_store

    model_args = model_args or {}
    n_layers = n_layers_of(model, model_args)
    layer = n_layers // 2 if layer is None else layer
    if not 0 <= layer < n_layers:
        raise PoolBenchError(f"--layer {layer} out of range for {model} ({n_layers} layers: 0..{n_layers - 1})")
    cfg = RunConfig(model=model, model_args=model_args, dtype=dtype, device=device,
                    corpus=str(calibration_corpus_dir(seed=0)), layers=(layer,),
                    strategies=CALIBRATION_STRATEGIES, store=store, batch_size=batch_size, max_length=MAX_LENGTH,
                    seed=seed, n_bootstrap=n_bootstrap, reliability=False, steering=False)
    outcome = run_benchmark(cfg, on_event)
    causal = outcome.model.get("kind") == "causal"
    artifact_store = open_store(cfg.resolved_store())
    scores = {}
    for concept, keys in outcome.artifacts.items():
        view = PooledTableView(read_pooled_layer(artifact_store, keys["pooled"], layer))
        for strategy in CALIBRATION_STRATEGIES:
            scores[(concept, strategy)] = held_out_scores(view, layer, strategy, seed)
    expectations = []
    for expectation in EXPECTATIONS:
        if expectation.causal_only and not causal:
            expectations.append({"id": expectation.id, "statement": expectation.statement, "held": None,
                                 "note": f"not applicable: {model} is not a causal LM"})
            continue
        expectations.append({**expectation_gap(expectation, scores, n_bootstrap=n_bootstrap, seed=seed),
                             "trained_only": expectation.trained_only})
    return {"model": outcome.model, "layer": layer, "probe": "logistic", "ci_level": CI_LEVEL,
            "corpus": outcome.corpus, "expectations": expectations}
