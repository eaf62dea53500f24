"""One `run --protocol pb` through the CLI on the default store (POOLBENCH_CACHE set for it, a relative --out), then
read back from another folder and another cache, as a user does after `make run`: the D1 equals scikit-learn's
StratifiedKFold over the train split in corpus order (the corpus files' order, not the stored table's), and every
command that reads the run's artifacts finds the store the run recorded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from tolerances import assert_float32_close
from typer.testing import CliRunner

from poolbench.cli.app import app
from poolbench.corpus.corpus_versions import generate_embedded_corpus
from poolbench.corpus.layout import write_corpus
from poolbench.pooler.pooled_table import read_pooled_table
from poolbench.store.local import LocalStore
from poolbench.store.url import run_store_url

CONCEPTS = ("hedging",)


@pytest.fixture(scope="module")
def default_store_run(tmp_path_factory, tiny_llama_dir, local_ray) -> dict[str, Path]:
    """A finished pb run on the default store of a cache of its own; afterwards the cache and cwd are others."""
    root = tmp_path_factory.mktemp("default-store")
    corpus = root / "corpus"
    # corpus v1: passages of 90-170 of the tiny Llama's tokens, so its pooling batches (longest first) store the
    # rows in another order than the corpus files' (v2's passages all fill its 256-token window: no reordering)
    write_corpus(corpus, {c: p for c, p in generate_embedded_corpus("tiny", version=1).items() if c in CONCEPTS})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POOLBENCH_CACHE", str(root / "cache"))
        patch.chdir(root)
        result = CliRunner().invoke(app, [
            "run", "--model", str(tiny_llama_dir), "--corpus", str(corpus), "--concepts", ",".join(CONCEPTS),
            "--strategies", "A1_mean,P1_last", "--layers", "1", "--protocol", "pb", "--no-steering",
            "--no-reliability", "--n-bootstrap", "50", "--torch-threads", "1", "--out", "run"])
        assert result.exit_code == 0, result.output
    return {"run": root / "run", "store": root / "cache" / "store", "corpus": corpus}


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("POOLBENCH_CACHE", str(tmp_path / "another-cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def corpus_train_ids(corpus: Path, concept: str) -> list[str]:
    """The train split's ids as the corpus files list them: train_pos, then train_neg, each in file order."""
    return [json.loads(line)["id"] for stem in ("train_pos", "train_neg")
            for line in (corpus / concept / f"{stem}.jsonl").read_text().splitlines() if line.strip()]


def sklearn_oof_auroc(X: np.ndarray, y: np.ndarray) -> float:
    """The reference's D1 as its steps read (pb_protocol's docstring), written from scikit-learn and numpy alone."""
    X = X.astype(np.float32)
    X = X / (np.linalg.norm(X, axis=1, keepdims=True) + np.float32(1e-9))
    oof = np.empty(len(y), dtype=np.float32)
    for fit, held in StratifiedKFold(n_splits=5, shuffle=True, random_state=42).split(X, y):
        d = X[fit][y[fit] == 1].mean(axis=0) - X[fit][y[fit] == 0].mean(axis=0)
        oof[held] = X[held] @ (d / (np.linalg.norm(d) + np.float32(1e-9)))
    return float(roc_auc_score(y, oof))


def stacked_d1(order: list[str], vector: dict[str, np.ndarray], label: dict[str, int]) -> float:
    """The reference's stacking: the positives, then the negatives, each in `order`."""
    pos, neg = [p for p in order if label[p] == 1], [p for p in order if label[p] == 0]
    return sklearn_oof_auroc(np.stack([vector[p] for p in pos + neg]), np.array([1] * len(pos) + [0] * len(neg)))


def test_pb_d1_through_run_is_sklearn_over_the_train_split_in_corpus_order(default_store_run, elsewhere):
    doc = json.loads((default_store_run["run"] / "results.json").read_text())
    assert doc["config"]["store"] is None and doc["config"]["protocol"] == "pb"
    store = LocalStore(default_store_run["store"])
    orders_differ, stored_order_numbers_differ = False, False
    for concept in CONCEPTS:
        rows = read_pooled_table(store, doc["artifacts"][concept]["pooled"]).to_pydict()
        ids = corpus_train_ids(default_store_run["corpus"], concept)
        for strategy in ("A1_mean", "P1_last"):
            train = [i for i, (s, split) in enumerate(zip(rows["strategy"], rows["split"], strict=True))
                     if s == strategy and split == "train"]
            vector = {rows["passage_id"][i]: np.asarray(rows["vector"][i]) for i in train}
            label = {rows["passage_id"][i]: rows["label"][i] for i in train}

            (cell,) = [c for c in doc["cells"] if c["concept"] == concept and c["strategy"] == strategy]
            # the same float32 scores give the same pair counts over n_pos * n_neg: equal to a few ulps of <= 1
            assert cell["cv_auroc"] == pytest.approx(stacked_d1(ids, vector, label), abs=1e-12), (concept, strategy)
            stored = [rows["passage_id"][i] for i in train]
            orders_differ |= stored != ids
            stored_order_numbers_differ |= stacked_d1(stored, vector, label) != stacked_d1(ids, vector, label)
    # the test can tell: the table's own order is another one, and folding in it gives other numbers
    assert orders_differ and stored_order_numbers_differ


def test_export_vector_reads_the_default_store_the_run_recorded(default_store_run, elsewhere):
    from safetensors.numpy import load_file

    result = CliRunner().invoke(app, ["export-vector", "--run", str(default_store_run["run"]), "--concept",
                                      "hedging", "--strategy", "A1_mean", "--layer", "1", "--unit", "raw",
                                      "--format", "safetensors", "--out", str(elsewhere / "vectors")])
    assert result.exit_code == 0, result.output
    (path,) = (elsewhere / "vectors").glob("*.safetensors")
    (tensor,) = load_file(str(path)).values()
    doc = json.loads((default_store_run["run"] / "results.json").read_text())
    rows = read_pooled_table(LocalStore(default_store_run["store"]), doc["artifacts"]["hedging"]["pooled"]).to_pydict()
    cell = [(np.asarray(v, dtype=np.float64), lab) for v, lab, s, split in zip(
        rows["vector"], rows["label"], rows["strategy"], rows["split"], strict=True)
        if s == "A1_mean" and split == "train"]
    diffmean = (np.mean([v for v, lab in cell if lab == 1], axis=0) - np.mean([v for v, lab in cell if lab == 0],
                                                                             axis=0))
    assert_float32_close(np.asarray(tensor, dtype=np.float64).ravel(), diffmean)


def test_power_and_the_service_open_the_run_s_store(default_store_run, elsewhere):
    from poolbench.http.settings import vectors_of_run

    result = CliRunner().invoke(app, ["power", "--run", str(default_store_run["run"]), "--strategies",
                                      "A1_mean,P1_last", "--concept", "hedging", "--layer", "1", "--n-bootstrap",
                                      "20", "--out", str(elsewhere)])
    assert result.exit_code == 0, result.output
    assert (elsewhere / "power_hedging_A1_mean_vs_P1_last.json").is_file()
    served = vectors_of_run(default_store_run["run"])  # what `capability`, /generate and serve-scorers read
    assert Path(served["vector_store"]) == default_store_run["store"]
    result = CliRunner().invoke(app, ["export-submission", "--run", str(default_store_run["run"]), "--strategy",
                                      "A1_mean", "--model-key", "llama3_8b", "--out", str(elsewhere)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("doc,url", [
    ({"store": "local:/data/cache/store", "config": {"store": None}}, "/data/cache/store"),
    ({"store": "local:/work/runs/s", "config": {"store": "runs/s"}}, "/work/runs/s"),  # relative where it ran
    ({"store": "s3://b/p @ http://127.0.0.1:9000", "config": {"store": "s3://b/p"}}, "s3://b/p"),
    ({"store": "s3://b/p @ http://127.0.0.1:9000", "config": {}}, "s3://b/p"),
])
def test_the_store_a_run_recorded(doc, url):
    assert run_store_url(doc) == url
