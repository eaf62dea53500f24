"""The spine end to end: corpus -> Ray extractor worker -> pooled artifact -> D1 task -> results, and resume."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from s3_server import ACCESS_KEY, REGION, SECRET_KEY
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from slow_strategy import write_slow_mean

from poolbench.config import RunConfig
from poolbench.corpus.source import open_corpus
from poolbench.driver.pipeline import run_benchmark
from poolbench.errors import StoreError
from poolbench.pooler.pooled_table import read_pooled_table
from poolbench.records.events import ConceptPooled, ConceptProbed, RunEvent, RunPlanned
from poolbench.results.documents.document import write_run_outputs
from poolbench.store.keys import layer_shard_key
from poolbench.store.url import open_store

CONCEPTS = ("hedging", "toxicity")
STRATEGIES = ("A1_mean", "P1_last", "P2_first")


def sha256_of_records(records: object) -> str:
    """bench/after_d1.py's hash of a stage's records (JSON, sorted keys)."""
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()


def config(model: Path, store: str, **overrides) -> RunConfig:
    # Corpus v1: small, nearly separable cells for the tiny model, so the counts below are stable.
    base = dict(model=str(model), corpus="embedded-v1", corpus_size="tiny", concepts=CONCEPTS,
                strategies=STRATEGIES, store=store, n_bootstrap=200, torch_threads=1, steering=False)
    return RunConfig(**{**base, **overrides})


def test_run_writes_every_cell_and_a_rerun_computes_nothing(tiny_llama_dir, local_ray, cache, tmp_path):
    events: list[RunEvent] = []
    cfg = config(tiny_llama_dir, str(tmp_path / "store"))
    outcome = run_benchmark(cfg, events.append)

    assert outcome.computed == {"pooled": 2, "d1": 2, "pooled_skipped": 0, "d1_skipped": 0}
    assert outcome.layers == [0, 1]
    # 2 concepts x 2 layers x 3 strategies x 2 probes
    assert len(outcome.records) == 24
    for cell in outcome.records:
        assert 0.0 <= cell.ci_low <= cell.test_auroc <= cell.ci_high <= 1.0
        assert cell.n_train == 48 and cell.n_test == 24
        assert cell.fallback_count == 0
        if cell.probe == "logistic":  # the per-cell reliability statistics ride on the primary probe
            assert len(cell.seed_cv_aurocs) == 5 and cell.seed_std >= 0.0
            assert cell.seed_cv_aurocs[0] == pytest.approx(cell.cv_auroc, abs=1e-6)
            assert cell.mdl_compression > 0 and -1.0 <= cell.selectivity <= 1.0
        else:
            assert cell.seed_std is None and cell.selectivity is None
    # P2 is the BOS token on a Llama tokenizer: the same vector for every passage, so no signal at all, and each
    # reliability statistic must say so: every seed's CV AUROC 0.5 (all scores tie), no spread, a control task
    # as unlearnable as the concept (selectivity 0.5 - 0.5 = 0), and no compression beyond the label prior's.
    p2 = [c for c in outcome.records if c.strategy == "P2_first"]
    assert all(c.test_auroc == 0.5 for c in p2)
    for cell in (c for c in p2 if c.probe == "logistic"):
        assert cell.seed_cv_aurocs == [0.5] * 5 and cell.seed_std == 0.0
        assert cell.control_cv_auroc == 0.5 and cell.selectivity == 0.0
        assert cell.mdl_compression <= 1.05
    [planned] = [e for e in events if isinstance(e, RunPlanned)]
    assert (planned.concepts, planned.layers, planned.strategies) == (CONCEPTS, (0, 1), STRATEGIES)
    assert (planned.n_layers, planned.hidden_size, planned.workers) == (2, 32, 1)
    pooled = [e for e in events if isinstance(e, ConceptPooled)]
    assert sorted(e.concept for e in pooled) == list(CONCEPTS) and not any(e.skipped for e in pooled)
    probed = [e for e in events if isinstance(e, ConceptProbed)]
    assert sorted(e.concept for e in probed) == list(CONCEPTS) and not any(e.skipped for e in probed)
    assert events.index(planned) == 0

    paths = write_run_outputs(outcome, tmp_path / "out")
    results = json.loads(paths["results"].read_text())
    assert results["config"]["concepts"] == list(CONCEPTS)
    assert results["model"]["weights_hash"] and results["corpus"]["hash"]
    assert set(results["versions"]) >= {"torch", "transformers", "scikit-learn", "ray", "poolbench"}
    assert results["reliability"]["strategies"] == sorted(STRATEGIES)
    leaderboard = json.loads(paths["leaderboard"].read_text())
    assert {row["strategy"] for row in leaderboard["strategies"]} == set(STRATEGIES)
    assert all(set(row["per_concept"]) == set(CONCEPTS) for row in leaderboard["strategies"])
    # bench/after_d1.py times what the driver computes after D1 on a finished run folder: it must recompute the
    # answer this run wrote, and its lexical baselines (hashed as results.json holds them) from the same corpus.
    bench = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "bench" / "after_d1.py"), "--run",
                            str(tmp_path / "out"), "--repeats", "1", "--out", str(tmp_path / "after_d1.json")],
                           capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr[-3000:]
    timed = json.loads((tmp_path / "after_d1.json").read_text())
    assert timed["cells"] == 24 and timed["concepts"] == 2 and set(timed["seconds_best"]) == {
        "read_scores", "join_write_read_scores", "lexical", "d1_by_tier", "d1_by_bucket", "answer"}
    assert timed["run_scores_file_bytes"] == (tmp_path / "out" / "passage_scores.arrow").stat().st_size
    answer = json.loads((tmp_path / "out" / "answer.json").read_text())
    assert timed["records_sha256"]["answer"] == sha256_of_records(answer)
    assert timed["records_sha256"]["lexical"] == sha256_of_records(
        [results["lexical_baseline"], results.get("lexical_by_tier", [])])

    store = open_store(cfg.resolved_store())
    for keys in outcome.artifacts.values():
        assert store.exists(keys["pooled"]) and store.exists(keys["d1"])

    replayed: list[RunEvent] = []
    again = run_benchmark(cfg, replayed.append)
    assert again.computed == {"pooled": 0, "d1": 0, "pooled_skipped": 2, "d1_skipped": 2}
    assert replayed[1:] == [ConceptPooled("hedging", skipped=True), ConceptProbed("hedging", skipped=True),
                            ConceptPooled("toxicity", skipped=True), ConceptProbed("toxicity", skipped=True)]
    assert again.records == outcome.records


def test_a_killed_run_resumes_where_it_stopped(tiny_llama_dir, local_ray, cache, tmp_path):
    cfg = config(tiny_llama_dir, str(tmp_path / "store"))
    first = run_benchmark(cfg)
    store = open_store(cfg.resolved_store())
    # As if the driver died after hedging's pooling but before its D1 and before anything of toxicity.
    store.delete(first.artifacts["hedging"]["d1"])
    for layer in (0, 1):
        store.delete(layer_shard_key(first.artifacts["hedging"]["d1"], layer))
    for key in (first.artifacts["toxicity"]["pooled"], first.artifacts["toxicity"]["d1"]):
        store.delete(key)
        for layer in (0, 1):
            store.delete(layer_shard_key(key, layer))
    resumed = run_benchmark(cfg)
    assert resumed.computed == {"pooled": 1, "d1": 2, "pooled_skipped": 1, "d1_skipped": 0}
    assert resumed.records == first.records


def test_a_run_killed_between_layer_shards_recomputes_only_the_missing_ones(tiny_llama_dir, local_ray, cache,
                                                                           tmp_path):
    """Killed after toxicity's layer-0 shard and D1 landed: the rerun pools layer 1 only, probes layer 1 only,
    leaves layer 0's files untouched and ends with the same cells."""
    cfg = config(tiny_llama_dir, str(tmp_path / "store"))
    first = run_benchmark(cfg)
    store = open_store(cfg.resolved_store())
    pooled, d1 = first.artifacts["toxicity"]["pooled"], first.artifacts["toxicity"]["d1"]
    kept = [tmp_path / "store" / f"{layer_shard_key(key, 0)}.arrow" for key in (pooled, d1)]
    stamps = [path.stat().st_mtime_ns for path in kept]
    for key in (pooled, layer_shard_key(pooled, 1), d1, layer_shard_key(d1, 1)):
        store.delete(key)
    # First on a disk too small for toxicity's layer 1 (its vectors' bytes): one line, before any forward.
    real_usage = shutil.disk_usage
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=1_000))
        with pytest.raises(StoreError, match=r"the pooling left \(1 concept, 72 passages\) needs at least "
                                             r"27648 bytes and its disk has 1000 bytes free"):
            run_benchmark(cfg)
    assert not store.exists(layer_shard_key(pooled, 1)) and not store.exists(pooled)
    resumed = run_benchmark(cfg)
    assert resumed.computed == {"pooled": 1, "d1": 1, "pooled_skipped": 1, "d1_skipped": 1}
    assert [path.stat().st_mtime_ns for path in kept] == stamps
    assert all(store.exists(layer_shard_key(key, 1)) for key in (pooled, d1)) and store.exists(pooled)
    assert [c.to_dict() for c in resumed.records] == [c.to_dict() for c in first.records]


def test_changing_a_determinant_gives_new_artifacts(tiny_llama_dir, local_ray, cache, tmp_path):
    cfg = config(tiny_llama_dir, str(tmp_path / "store"), concepts=("hedging",))
    first = run_benchmark(cfg)
    reseeded = run_benchmark(config(tiny_llama_dir, str(tmp_path / "store"), concepts=("hedging",), seed=1))
    assert reseeded.artifacts["hedging"]["pooled"] == first.artifacts["hedging"]["pooled"]
    assert reseeded.artifacts["hedging"]["d1"] != first.artifacts["hedging"]["d1"]
    assert reseeded.computed == {"pooled": 0, "d1": 1, "pooled_skipped": 1, "d1_skipped": 0}
    # Neither the batch budget nor the threads are determinants: such a run reads the stored tables, bit for bit
    # (docs/reproducibility.md), where computing them afresh would agree only to round-off.
    rebudgeted = run_benchmark(config(tiny_llama_dir, str(tmp_path / "store"), concepts=("hedging",),
                                      max_batch_tokens=16, torch_threads=2))
    assert rebudgeted.computed == {"pooled": 0, "d1": 0, "pooled_skipped": 1, "d1_skipped": 1}
    assert rebudgeted.artifacts == first.artifacts
    flash = run_benchmark(config(tiny_llama_dir, str(tmp_path / "store"), concepts=("hedging",), flash="1/2"))
    assert flash.computed == {"pooled": 0, "d1": 1, "pooled_skipped": 1, "d1_skipped": 0}
    assert {c.n_train for c in flash.records} == {24} and {c.n_test for c in flash.records} == {24}
    from poolbench.prober.flash import FlashError

    with pytest.raises(FlashError, match="concept hedging: flash fraction 1/64"):
        run_benchmark(config(tiny_llama_dir, str(tmp_path / "store"), concepts=("hedging",), flash="1/64"))
    fewer_layers = run_benchmark(config(tiny_llama_dir, str(tmp_path / "store"), concepts=("hedging",),
                                        layers=(1,)))
    assert fewer_layers.artifacts["hedging"]["pooled"] != first.artifacts["hedging"]["pooled"]
    assert {c.layer for c in fewer_layers.records} == {1}


def test_run_through_a_real_s3_server(tiny_llama_dir, local_ray, cache, tmp_path, moto_s3, monkeypatch):
    bucket = moto_s3.make_bucket("poolbench-pipeline")
    monkeypatch.setenv("POOLBENCH_S3_ENDPOINT", moto_s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", REGION)
    # Ray workers were started before these variables existed: pass them as the job would on a cluster.
    url = f"s3://{bucket}/run"
    cfg = config(tiny_llama_dir, url, concepts=("hedging",), strategies=("A1_mean",))
    outcome = run_benchmark(cfg)
    store = open_store(url)
    assert store.exists(outcome.artifacts["hedging"]["pooled"])
    assert store.get_table(outcome.artifacts["hedging"]["d1"]).num_rows == 4
    assert run_benchmark(cfg).computed["pooled_skipped"] == 1


def test_dump_activations_and_export_submission(tiny_llama_dir, local_ray, cache, tmp_path):
    from poolbench.cli.app import export_submission

    cfg = config(tiny_llama_dir, str(tmp_path / "store"), concepts=("hedging",), strategies=("A1_mean",),
                 dump_activations=True)
    outcome = run_benchmark(cfg)
    store = open_store(cfg.resolved_store())
    dump_keys = [k for k in store.list("activations")]
    assert len(dump_keys) == 1
    dump = store.get_table(dump_keys[0])
    pooled = read_pooled_table(store, outcome.artifacts["hedging"]["pooled"])
    n_passages = pooled.num_rows // 2  # one A1 row per passage per layer, 2 layers
    assert set(dump.column("layer").to_pylist()) == {0, 1}
    assert len(set(dump.column("passage_id").to_pylist())) == n_passages

    out = tmp_path / "run"
    write_run_outputs(outcome, out)
    export_submission(strategy="A1_mean", model_key="llama3_8b", run_dir=out, source="community", out=None,
                      allow_other_protocol=True)  # this run's D1 is PoolBench's protocol: labelled, and a sidecar
    assert json.loads((out / "submission_A1_mean.protocol.json").read_text())["protocol"] == "poolbench"
    submission = json.loads((out / "submission_A1_mean.json").read_text())
    jsonschema.validate(submission, json.loads((Path(__file__).parent / "data" / "submission_schema.json").read_text()))
    assert submission["family"] == "uniform_aggregation"
    result = submission["results"]["llama3_8b"]
    assert set(result["per_concept"]) == {"hedging"}
    assert 0.0 <= result["mean_auroc"] <= 1.0 and result["layer"] in (0, 1)


def test_a_corrupt_artifact_is_quarantined_and_recomputed_not_fatal(tiny_llama_dir, local_ray, cache, tmp_path):
    """Bit rot in one concept's pooled vectors: the rerun warns, moves it aside, recomputes that concept only
    (the healthy concept's artifacts are kept) and ends with the same cells as the first run."""
    from poolbench.records.events import ArtifactQuarantined

    cfg = config(tiny_llama_dir, str(tmp_path / "store"))
    first = run_benchmark(cfg)
    bad = layer_shard_key(first.artifacts["toxicity"]["pooled"], 1)
    path = tmp_path / "store" / f"{bad}.arrow"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    events: list[RunEvent] = []
    again = run_benchmark(cfg, events.append)
    quarantined = [e for e in events if isinstance(e, ArtifactQuarantined)]
    assert [e.key for e in quarantined] == [bad] and quarantined[0].reason.startswith("sha256 mismatch")
    assert again.computed == {"pooled": 1, "d1": 0, "pooled_skipped": 1, "d1_skipped": 2}
    assert open_store(cfg.resolved_store()).check(f"quarantine/{bad}") is None
    assert [c.to_dict() for c in again.records] == [c.to_dict() for c in first.records]


def test_concepts_sharing_a_pooling_job_with_parses_ahead_give_the_run_of_the_worker_parsing(tiny_llama_dir,
                                                                                             local_ray, cache,
                                                                                             tmp_path):
    """Both concepts in one pooling job (as a GPU run groups them), once with the worker parsing before its first
    forward and once with --overlap: parse tasks on the CPU first, the group's job when both are stored, the
    next chunk prepared beside each forward. Same records; each concept pooled, probed and reported once."""
    strategies = ("A1_mean", "L1_pos_filtered", "L5_keyword")
    runs = {}
    for overlap in (False, True):
        events: list[RunEvent] = []
        cfg = config(tiny_llama_dir, str(tmp_path / f"store-{overlap}"), strategies=strategies,
                     concept_group_tokens=10**6, overlap=overlap, reliability=False, n_bootstrap=50)
        runs[overlap] = (run_benchmark(cfg, events.append), events)
    (serial, serial_events), (ahead, ahead_events) = runs[False], runs[True]
    assert serial.computed == {"pooled": 2, "d1": 2, "pooled_skipped": 0, "d1_skipped": 0}
    assert ahead.computed == {**serial.computed, "parsed_ahead": 2}
    assert ahead.records == serial.records and len(serial.records) == 2 * 2 * 3 * 2
    for events in (serial_events, ahead_events):
        assert sorted(e.concept for e in events if isinstance(e, ConceptPooled)) == list(CONCEPTS)
        assert sorted(e.concept for e in events if isinstance(e, ConceptProbed)) == list(CONCEPTS)


def test_on_cpu_the_probes_wait_for_the_pooling_and_with_overlap_they_run_beside_it(tiny_llama_dir, local_ray, cache,
                                                                                  tmp_path):
    """On CPU a probe task beside the forward takes the cores of its OpenMP team (probe_gate.py): every concept is
    pooled before the first is probed. With --overlap the first concept's probe reports while the second pools: the
    order the gate holds is not the order the queue falls into by itself."""
    from poolbench.pooler.registry import unregister_strategy

    plugin = write_slow_mean(tmp_path, "X9_slow_mean", 1.5)  # the second pooling outlasts the first probe task
    orders = {}
    try:
        for overlap in (None, True):
            events: list[RunEvent] = []
            cfg = config(tiny_llama_dir, str(tmp_path / f"store-{overlap}"), strategies=("A1_mean", "X9_slow_mean"),
                         layers=(1,), overlap=overlap, reliability=False, n_bootstrap=50, concept_group_tokens=0)
            outcome = run_benchmark(cfg, events.append, strategy_modules=(str(plugin),))
            assert outcome.computed == {"pooled": 2, "d1": 2, "pooled_skipped": 0, "d1_skipped": 0}
            orders[overlap] = [type(e).__name__ for e in events if isinstance(e, ConceptPooled | ConceptProbed)]
    finally:
        unregister_strategy("X9_slow_mean")
    assert orders[None] == ["ConceptPooled", "ConceptPooled", "ConceptProbed", "ConceptProbed"]
    assert orders[True] == ["ConceptPooled", "ConceptProbed", "ConceptPooled", "ConceptProbed"]


def reference_oof_d1(pos: np.ndarray, neg: np.ndarray) -> tuple[float, float, float]:
    """The official leaderboard's D1 as its evaluation code (2023mc21517-arch/poolbench, poolbench/evaluation/
    probe.py, compute_train_test_auroc_for_strategy, protocol "5fold_oof"; the repository the issue names at commit
    2ec219d) computes it, step by step as read there: float32 rows, each / (norm + 1e-9); positives stacked over
    negatives; StratifiedKFold(5, shuffle=True, random_state=42); per fold the unit difference of class means;
    out-of-fold scores x . d; one roc_auc_score; 1,000 resamples from default_rng(42).integers(0, n, (1000, n)),
    one-class resamples skipped; the 2.5th and 97.5th percentiles."""
    pos = pos.astype(np.float32) / (np.linalg.norm(pos.astype(np.float32), axis=1, keepdims=True) + 1e-9)
    neg = neg.astype(np.float32) / (np.linalg.norm(neg.astype(np.float32), axis=1, keepdims=True) + 1e-9)
    X, y = np.vstack([pos, neg]), np.array([1] * len(pos) + [0] * len(neg), dtype=np.int32)
    oof = np.empty(len(y), dtype=np.float32)
    for fit, held in StratifiedKFold(n_splits=5, shuffle=True, random_state=42).split(X, y):
        d = X[fit][y[fit] == 1].mean(axis=0) - X[fit][y[fit] == 0].mean(axis=0)
        oof[held] = X[held] @ (d / (np.linalg.norm(d) + 1e-9))
    draws = np.random.default_rng(42).integers(0, len(y), size=(1000, len(y)))
    boot = [roc_auc_score(y[r], oof[r]) for r in draws if len(np.unique(y[r])) == 2]
    return float(roc_auc_score(y, oof)), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


@pytest.mark.numerics
def test_protocol_pb_run_gives_the_reference_d1_and_exports_unlabelled(tiny_llama_dir, local_ray, cache, tmp_path):
    from poolbench.cli.app import export_submission

    cfg = config(tiny_llama_dir, str(tmp_path / "store"), concepts=("hedging",),
                 strategies=("A1_mean",), layers=(1,), protocol="pb", n_bootstrap=1000)  # one fixed layer
    outcome = run_benchmark(cfg)
    assert outcome.records and all(r.protocol == "pb" and r.probe == "diffmean" and r.n_test == 0
                                   for r in outcome.records)
    pooled = read_pooled_table(open_store(cfg.resolved_store()), outcome.artifacts["hedging"]["pooled"])
    rows = pooled.to_pydict()
    # the reference stacks the train split in corpus order (the corpus files'), not the stored table's
    rank = {p.id: i for i, p in enumerate(open_corpus("embedded-v1", "tiny", ["hedging"]).passages("hedging"))}
    for record in outcome.records:
        cell = [(v, label) for pid, v, label, layer, strategy, split in sorted(zip(
            rows["passage_id"], rows["vector"], rows["label"], rows["layer"], rows["strategy"], rows["split"],
            strict=True), key=lambda row: rank[row[0]])
            if layer == record.layer and strategy == record.strategy and split == "train"]
        pos = np.array([v for v, label in cell if label == 1])
        neg = np.array([v for v, label in cell if label == 0])
        auroc, low, high = reference_oof_d1(pos, neg)
        # AUROCs are counts of score pairs over n_pos * n_neg: the same float32 scores give the same counts, and
        # the two bootstrap paths sum the same counts in another order (a few ulps of a value <= 1)
        assert record.cv_auroc == record.test_auroc == pytest.approx(auroc, abs=1e-12)
        assert (record.ci_low, record.ci_high) == (pytest.approx(low, abs=1e-12), pytest.approx(high, abs=1e-12))
        assert record.n_train == len(pos) + len(neg)
    out = tmp_path / "run"
    write_run_outputs(outcome, out)
    board = json.loads((out / "leaderboard.json").read_text())
    assert board["protocol"] == "pb" and {r["protocol"] for r in board["strategies"]} == {"pb"}
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["protocol"] == "pb" and {c["protocol"] for c in results["cells"]} == {"pb"}
    export_submission(strategy="A1_mean", model_key="llama3_8b", run_dir=out, source="community", out=None,
                      allow_other_protocol=False)
    assert not (out / "submission_A1_mean.protocol.json").exists()
    assert not json.loads((out / "submission_A1_mean.json").read_text())["description"].startswith("[D1")
