"""One run over two tiny models: each model's folder is what a single-model run writes, the run folder holds the
cross-model table, a rerun computes nothing, and bad model lists stop before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
from scipy.stats import spearmanr

from poolbench.api import evaluate_config, evaluate_models
from poolbench.cli.cross_model_board import cross_model_answer, cross_model_board
from poolbench.config import RunConfig
from poolbench.driver.extractor_fleet import ExtractorFleet
from poolbench.errors import PoolBenchError
from poolbench.records.events import RunPlanned

CONCEPTS = ("hedging", "toxicity")
STRATEGIES = ("A1_mean", "P1_last", "A2_max")


@pytest.fixture(scope="session")
def deeper_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny model: 3 layers, d=48, another seed, so depths and rankings differ from tiny_llama_dir's."""
    from tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("models") / "deeper-llama", seed=7, layers=3, hidden=48)


def config(out: Path, store: Path) -> RunConfig:
    return RunConfig(corpus="embedded-v1", corpus_size="tiny", concepts=CONCEPTS, strategies=STRATEGIES,
                     store=str(store), out=str(out), n_bootstrap=100, torch_threads=1, steering=False,
                     reliability=False)


def test_two_models_one_run_folder_and_a_rerun_computes_nothing(tiny_llama_dir, deeper_llama_dir, local_ray,
                                                                 cache, tmp_path):
    models = (str(tiny_llama_dir), str(deeper_llama_dir))
    cfg = config(tmp_path / "run", tmp_path / "store")
    events: list[object] = []
    results = evaluate_models(cfg, models, on_event=events.append)
    planned = [e for e in events if isinstance(e, RunPlanned)]
    assert [e.n_layers for e in planned] == [2, 3]
    assert planned[0].worker_pids == planned[1].worker_pids  # the second model ran on the first model's workers

    folders = {m["name"]: m["folder"] for m in results.document["models"]}
    assert folders == {models[0]: models[0].strip("/").replace("/", "_"),
                       models[1]: models[1].strip("/").replace("/", "_")}
    for name in models:  # each model's folder: the single-model files, with that model's own cells
        folder = tmp_path / "run" / folders[name]
        assert {p.name for p in folder.glob("*.json")} >= {"results.json", "leaderboard.json"}
        assert (folder / "leaderboard_long.csv").is_file() and (folder / "leaderboard_wide.csv").is_file()
        own = json.loads((folder / "results.json").read_text())
        assert own["config"]["model"] == name and own["config"]["out"] == str(folder)
        assert own["computed"] == {"pooled": 2, "d1": 2, "pooled_skipped": 0, "d1_skipped": 0}
    assert json.loads((tmp_path / "run" / folders[models[1]] / "results.json").read_text())["layers"] == [0, 1, 2]

    # A single-model run of the first model writes the same keys and, from the same store, the same numbers.
    single = evaluate_config(cfg.model_copy(update={"model": models[0], "out": str(tmp_path / "single")}))
    first = results.per_model[models[0]]
    assert set(single.document) == set(first.document)
    assert single.document["computed"] == {"pooled": 0, "d1": 0, "pooled_skipped": 2, "d1_skipped": 2}
    assert single.mean_d1() == first.mean_d1()
    assert set(single.leaderboard) == set(first.leaderboard)

    document = json.loads((tmp_path / "run" / "results.json").read_text())
    assert document["kind"] == "cross_model" and document["config"]["model"] == list(models)
    table = document["cross_model"]
    assert [m["n_layers"] for m in table["models"]] == [2, 3]
    assert set(table["strategies"]) == set(STRATEGIES) and table["concepts"] == list(CONCEPTS)
    # Hand check: W of two rankings is (1 + Spearman's rho) / 2 of the per-model mean D1 (rho with scipy's ties).
    means = [[results.per_model[m].mean_d1()[s] for s in STRATEGIES] for m in models]
    rho = spearmanr(means[0], means[1]).statistic
    assert table["agreement"]["kendall_w"] == pytest.approx((1 + rho) / 2, abs=1e-12)
    for row in table["rows"]:
        for name, cell in row["per_model"].items():
            board_row = next(r for r in results.per_model[name].leaderboard["strategies"]
                             if r["strategy"] == row["strategy"])
            assert cell["mean_d1"] == pytest.approx(board_row["mean_d1"], abs=1e-12)
            assert cell["relative_depth"] == board_row["best_layer"] / (cell["n_layers"] - 1)
    assert json.loads((tmp_path / "run" / "leaderboard.json").read_text())["cross_model"] == table
    assert (tmp_path / "run" / "cross_model.csv").read_text().count("\n") == 1 + 2 * len(STRATEGIES)
    assert "Kendall's W" in cross_model_answer(table) and cross_model_board(table).row_count == len(STRATEGIES)

    again = evaluate_models(cfg, models)
    for name in models:
        assert again.per_model[name].document["computed"] == {"pooled": 0, "d1": 0, "pooled_skipped": 2,
                                                               "d1_skipped": 2}
    assert again.document["cross_model"]["agreement"] == table["agreement"]


def test_bad_model_lists_stop_before_any_model_loads(tiny_llama_dir, tmp_path):
    cfg = config(tmp_path / "run", tmp_path / "store")
    with pytest.raises(PoolBenchError, match="given twice"):
        evaluate_models(cfg, (str(tiny_llama_dir), str(tiny_llama_dir)))
    with pytest.raises(PoolBenchError, match="share the results folder"):
        evaluate_models(cfg, ("a/b", "a_b"))
    with pytest.raises(PoolBenchError, match="not found"):  # the second model is missing: the first never runs
        evaluate_models(cfg, (str(tiny_llama_dir), str(tmp_path / "no-such-model")))
    assert not (tmp_path / "run").exists()


def test_a_fleet_loads_each_model_once_per_worker_and_never_per_concept(tiny_llama_dir, deeper_llama_dir, local_ray,
                                                                       cache, tmp_path):
    """Two models over two concepts pooled one concept a job: each worker's loads are one per model, in order, and a
    model given again is not reloaded; the fleet's workers are gone once it closes."""
    models = (str(tiny_llama_dir), str(deeper_llama_dir))
    cfg = config(tmp_path / "run", tmp_path / "store").model_copy(update={"concept_group_tokens": 0})
    with ExtractorFleet() as fleet:
        pooled = []
        for name in (*models, models[1]):
            out = evaluate_config(cfg.model_copy(update={"model": name, "out": str(tmp_path / f"run{len(pooled)}")}),
                                  fleet=fleet)
            pooled.append(out.document["computed"]["pooled"])
        assert pooled == [2, 2, 0]  # one job per concept, and the repeat finds them stored
        workers = list(fleet.actors)
        assert [ray.get(w.loads.remote()) for w in workers] == [list(models)] * len(workers)
        # The same model asked for in another dtype is loaded again, not taken as already held.
        evaluate_config(cfg.model_copy(update={"model": models[1], "dtype": "float32", "out": str(tmp_path / "f")}),
                        fleet=fleet)
        assert [ray.get(w.loads.remote()) for w in workers] == [[*models, models[1]]] * len(workers)
    assert fleet.actors == []
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(workers[0].pid.remote(), timeout=30)


def test_steering_runs_per_model_and_its_d2_sits_in_the_cross_model_table(tiny_llama_dir, deeper_llama_dir,
                                                                         local_ray, cache, tmp_path):
    """With steering on, each model's extractors are stopped before its steering stage (its engine wants the same
    cores) and started again for the next model; each model steers its own cells and the table carries its D2."""
    models = (str(tiny_llama_dir), str(deeper_llama_dir))
    cfg = config(tmp_path / "run", tmp_path / "store").model_copy(update={
        "concepts": ("imdb_sentiment", "frustration"), "strategies": ("A1_mean", "P1_last"), "steering": True,
        "allow_weak_scorer": True})
    events: list[object] = []
    results = evaluate_models(cfg, models, on_event=events.append)
    planned = [e for e in events if isinstance(e, RunPlanned)]
    assert len(planned) == 2 and not set(planned[0].worker_pids) & set(planned[1].worker_pids)
    for name in models:
        d2 = results.per_model[name].d2
        assert sorted(r.concept for r in d2) == ["frustration", "frustration", "imdb_sentiment", "imdb_sentiment"]
        assert all(r.status == "ok" for r in d2)
    rows = {r["strategy"]: r for r in results.document["cross_model"]["rows"]}
    for name in models:
        steered = results.per_model[name].leaderboard["steering"]
        for strategy, cell in steered.items():
            assert rows[strategy]["per_model"][name]["mean_d2_delta"] == cell["mean_d2_delta"]


def test_switching_a_worker_frees_the_model_it_held(tiny_llama_dir, deeper_llama_dir, tmp_path):
    """After pooling with the first model, switch_model leaves nothing holding it (a GPU would otherwise hold two
    models at once), and the worker pools with the second model's depth."""
    import gc
    import weakref

    from negation_pairs import passages

    from poolbench.pooler.worker import ExtractorWorker

    worker = ExtractorWorker(str(tiny_llama_dir), torch_threads=1)
    data = passages(4, "train") + passages(2, "test")
    kwargs = {"store_url": str(tmp_path / "store"), "metadata": {"concept": "negation"}, "batch_size": 4,
              "max_length": 32}
    worker.pool_concept("negation", data, [0, 1], ["A1_mean", "S2_gradient"], key="pooled/a", **kwargs)
    first = weakref.ref(worker.loaded.model)
    info = worker.switch_model(str(deeper_llama_dir))
    gc.collect()
    assert first() is None
    assert info["n_layers"] == 3 and worker.loads() == [str(tiny_llama_dir), str(deeper_llama_dir)]
    summary = worker.pool_concept("negation", data, [2], ["A1_mean"], key="pooled/b", **kwargs)
    assert summary["layers"] == [2] and summary["rows"] == len(data)


def test_a_worker_lost_between_models_is_replaced_for_the_next(tiny_llama_dir, deeper_llama_dir, local_ray, cache,
                                                               tmp_path):
    """The fleet's only worker dies after the first model: the switch drops it and a new worker, loading only the
    second model, pools that model's concepts."""
    models = (str(tiny_llama_dir), str(deeper_llama_dir))
    cfg = config(tmp_path / "run", tmp_path / "store").model_copy(update={"concepts": ("hedging",)})
    with ExtractorFleet() as fleet:
        evaluate_config(cfg.model_copy(update={"model": models[0], "out": str(tmp_path / "a")}), fleet=fleet)
        [lost] = fleet.actors
        ray.kill(lost, no_restart=True)
        second = evaluate_config(cfg.model_copy(update={"model": models[1], "out": str(tmp_path / "b")}),
                                 fleet=fleet)
        assert second.document["computed"]["pooled"] == 1 and second.document["layers"] == [0, 1, 2]
        [new] = fleet.actors
        assert new is not lost and ray.get(new.loads.remote()) == [models[1]]
