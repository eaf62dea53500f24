"""The length axis on a real model: probes trained on the train split at length 1, the test split read as it is
(k = 1) and inside k x its length of neutral text (poolbench.corpus.long_context), D1 (held-out logistic AUROC)
per strategy per k at the middle default layer. Writes bench/results/long_context.json.

    python bench/long_context.py --concepts 3 --lengths 1,4 --strategies A1_mean,A2_max,P1_last
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from bench_io import write_result

from poolbench.corpus.long_context import in_context
from poolbench.corpus.source import open_corpus
from poolbench.driver.pipeline import default_layers
from poolbench.extractor.loading import EMBEDDED, load_model
from poolbench.pooler.concept_pooling import pool_concept_tables
from poolbench.pooler.pooled_table import PooledTableView
from poolbench.pooler.registry import resolve_strategies
from poolbench.prober.d1 import evaluate_d1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=EMBEDDED)
    parser.add_argument("--corpus-size", default="small")
    parser.add_argument("--concepts", type=int, default=3)
    parser.add_argument("--lengths", default="1,4")
    parser.add_argument("--strategies", default="A1_mean,A2_max,P1_last")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--out", default="results/long_context.json")
    args = parser.parse_args()
    start = time.perf_counter()
    loaded = load_model(args.model)
    layer = default_layers(loaded.n_layers)[len(default_layers(loaded.n_layers)) // 2]
    specs = resolve_strategies(args.strategies.split(","))
    corpus = open_corpus(EMBEDDED, args.corpus_size)
    lengths = [int(k) for k in args.lengths.split(",")]
    rows = []
    for concept in corpus.concepts[: args.concepts]:
        passages = corpus.passages(concept)
        train = [p for p in passages if p.split == "train"]
        test = [p for p in passages if p.split == "test"]
        for k in lengths:
            long_test = [in_context(p, k, seed=0) for p in test]
            view = PooledTableView(pool_concept_tables(loaded, train + long_test, [layer], specs,
                                                       max_length=args.max_length).pooled)
            for spec in specs:
                cell = view.matrix(layer, spec.id)
                tr, te = cell.subset("train"), cell.subset("test")
                result = evaluate_d1(tr.X, tr.y, tr.groups, te.X, te.y, te.groups, n_bootstrap=200)["logistic"]
                rows.append({"concept": concept, "k": k, "strategy": spec.id, "test_auroc": result.test_auroc,
                             "ci": [result.ci_low, result.ci_high]})
                print(concept, k, spec.id, round(result.test_auroc, 3), flush=True)
    mean = {f"{s.id}@k{k}": float(np.mean([r["test_auroc"] for r in rows if r["strategy"] == s.id and r["k"] == k]))
            for s in specs for k in lengths}
    write_result({"model": args.model, "layer": layer, "lengths": lengths, "rows": rows, "mean_test_auroc": mean,
                  "seconds": time.perf_counter() - start}, Path(args.out))
    print(json.dumps(mean, indent=1))


if __name__ == "__main__":
    main()
