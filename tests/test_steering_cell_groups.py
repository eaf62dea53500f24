"""Several steering cells in one generate call: the records and generations equal one cell at a time, identical rows
are generated once (hand-counted), a group with a stored cell generates only the other cell's rows, and the driver's
grouping of cells per engine and call."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tolerances import assert_records_close, float32_atol
from word_scorer import WordScorer

from poolbench.corpus.passage import Passage
from poolbench.extractor.loading import load_model
from poolbench.pooler.pooled_table import PooledTableBuilder
from poolbench.steerer.backend import GenerationSettings
from poolbench.steerer.generation_rows import GenerationRow, call_layers, distinct_rows
from poolbench.steerer.plan import SteeringCell, cell_groups, cells_per_call, rows_per_cell
from poolbench.steerer.run import CellInputs, SteeringConfig, run_steering, run_steering_cells
from poolbench.steerer.worker import SteeringWorker
from poolbench.store.local import LocalStore

PROMPTS = ["the cat sat on", "a dog", "birds sang in the trees near the river", "near the park the"]
TEXTS = ["the cat sat on a mat", "a dog ran to the park", "birds sang in trees", "the river ran near the park"]
CONCEPTS = ("imdb_sentiment", "frustration")  # each the other's D3 neighbour


@pytest.fixture(scope="module")
def worker(layered_llama_dir: Path) -> SteeringWorker:
    return SteeringWorker(load_model(str(layered_llama_dir), device="cpu"))


def _table(concept: str, d: int, seed: int):
    """Pooled A1_mean vectors at layers 0 and 1 whose train DiffMean is a random direction of norm 3 per layer."""
    passages = [Passage(f"{split}-{i}-{label}", TEXTS[i % len(TEXTS)], label, "d", 4, None, split, concept)
                for split, k in (("train", 6), ("test", 3)) for i in range(k) for label in (1, 0)]
    rng = np.random.default_rng(seed)
    vecs = rng.normal(size=(2, 1, len(passages), d)).astype(np.float32)
    labels = np.array([p.label for p in passages])
    for layer in (0, 1):
        direction = rng.normal(size=d).astype(np.float32)
        vecs[layer, 0, labels == 1] += 3 * direction / np.linalg.norm(direction)
    builder = PooledTableBuilder(passages, d)
    builder.add(vecs, [0, 1], ["A1_mean"], [p.id for p in passages], np.zeros(len(passages), bool))
    return builder.table(), [p.text for p in passages if p.split == "train"]


@pytest.fixture(scope="module")
def inputs(worker) -> dict:
    d = worker.loaded.hidden_size
    tables, train = {}, {}
    for seed, concept in enumerate(CONCEPTS):
        tables[concept], train[concept] = _table(concept, d, seed)
    return {"tables": tables, "train": train,
            "scorers": {"imdb_sentiment": WordScorer("imdb_sentiment", "e"),
                        "frustration": WordScorer("frustration", "a")}}


def _cell(inputs: dict, concept: str, layer: int) -> CellInputs:
    return CellInputs(concept, "A1_mean", layer, inputs["tables"][concept], inputs["train"][concept],
                      neighbour_tables=inputs["tables"])


def _config(tmp_path: Path) -> SteeringConfig:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return SteeringConfig(alphas=(0.0, 0.5, 2.0), n_prompts=None, prompts_file=str(path),
                          settings=GenerationSettings(max_new_tokens=5), n_bootstrap=50, fluency_guard=1e6)


class Counting:
    """The worker, with every generate_rows and reference_nll call recorded."""

    def __init__(self, worker: SteeringWorker) -> None:
        self.worker = worker
        self.generate_calls: list[dict] = []
        self.nll_calls: list[int] = []

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def generate_rows(self, prompts, **kwargs):
        self.generate_calls.append({"prompts": list(prompts), **kwargs})
        return self.worker.generate_rows(prompts, **kwargs)

    def reference_nll(self, texts, option="auto"):
        self.nll_calls.append(len(texts))
        return self.worker.reference_nll(texts, option)


# Rows generated in one call with other cells' rows: the same tokens (a flip needs two logits within round-off of
# each other, docs/reproducibility.md), their log-probabilities within the layered Llama's round-off (2 layers of 32
# hidden, 64 MLP and up to 64 positions, then the 320-token log-softmax) relative to their size, which the fluency
# guard (1e6) caps at ln(1e6) < 16 per token for any row kept; a perplexity is exp of their mean, so its relative
# error is that absolute one, and a ratio of two perplexities (fluency) doubles it (tests/tolerances.py).
D2_REL = 2 * float32_atol(16.0, 2 * (32 + 64 + 64) + 320)


def _without_seconds(result) -> dict:
    out = result.to_dict()
    out["d2"].pop("seconds")
    return out


@pytest.mark.numerics  # rows generated beside other cells' rows: bounded, and run on each kernel set
def test_a_group_of_cells_gives_what_each_cell_gives_alone(worker, inputs, tmp_path):
    config = _config(tmp_path)
    cells = [_cell(inputs, "imdb_sentiment", 0), _cell(inputs, "imdb_sentiment", 1), _cell(inputs, "frustration", 1)]
    counting = Counting(worker)
    together = run_steering_cells(LocalStore(tmp_path / "group"), counting, cells, inputs["scorers"], config)
    assert len(counting.generate_calls) == 1 and len(counting.nll_calls) == 1
    alone_store = LocalStore(tmp_path / "alone")
    alone = [run_steering(alone_store, worker, c.concept, c.strategy, c.layer, c.pooled_table, inputs["scorers"],
                          config, train_texts=c.train_texts, neighbour_tables=c.neighbour_tables) for c in cells]
    for group_result, single in zip(together, alone, strict=True):
        assert group_result.key == single.key  # grouping never enters the key
        assert_records_close(_without_seconds(group_result), _without_seconds(single), rel=D2_REL, err_msg="d2")
        assert group_result.d2.status == "ok" and group_result.d2.scp is not None
        assert LocalStore(tmp_path / "group").get_table(group_result.d2.generations_key).equals(
            alone_store.get_table(single.d2.generations_key))
    # The cells differ (another layer, another concept), so equal records are not one record copied.
    texts = [alone_store.get_table(r.d2.generations_key).column("text").to_pylist() for r in alone]
    assert texts[0] != texts[1] != texts[2] and texts[0][:4] == texts[1][:4]  # alpha = 0 rows are shared
    assert len({r.key for r in together}) == 3


def test_identical_rows_are_generated_once(worker, inputs, tmp_path):
    """2 cells x 3 alphas x 4 prompts + 4 prompted each = 32 rows; distinct: the 4 alpha = 0 rows once, 2 x 2 x 4
    steered rows, and the prompted rows once per concept: 4 + 16 + 4 = 24 for one concept at two layers, 4 + 16 +
    8 = 28 for two concepts."""
    config = _config(tmp_path)
    for cells, rows in (([("imdb_sentiment", 0), ("imdb_sentiment", 1)], 24),
                        ([("imdb_sentiment", 0), ("frustration", 1)], 28)):
        counting = Counting(worker)
        run_steering_cells(LocalStore(tmp_path / f"s{rows}"), counting, [_cell(inputs, c, L) for c, L in cells],
                           inputs["scorers"], config)
        (call,) = counting.generate_calls
        assert len(call["prompts"]) == rows
        # first-seen order: the first cell's alpha = 0, steered (layer 0) and prompted rows, then the second cell's
        # steered rows at layer 1 (and its own prompted rows); unsteered rows go at the first steered layer, 0
        assert call["layer"] == [0] * 4 + [0] * 8 + [0] * 4 + [1] * 8 + [0] * (rows - 24)
    # One cell alone: its 3 x 4 + 4 rows at its own layer, as before grouping existed.
    counting = Counting(worker)
    run_steering_cells(LocalStore(tmp_path / "one"), counting, [_cell(inputs, "frustration", 1)], inputs["scorers"],
                       config)
    assert len(counting.generate_calls[0]["prompts"]) == 16 and counting.generate_calls[0]["layer"] == 1


def test_a_group_with_a_stored_cell_generates_only_the_others_rows(worker, inputs, tmp_path):
    config = _config(tmp_path)
    store = LocalStore(tmp_path / "store")
    first = run_steering_cells(store, worker, [_cell(inputs, "imdb_sentiment", 1)], inputs["scorers"], config)[0]
    counting = Counting(worker)
    again = run_steering_cells(store, counting, [_cell(inputs, "imdb_sentiment", 1),
                                                 _cell(inputs, "frustration", 0)], inputs["scorers"], config)
    assert again[0] == first  # read back as stored, seconds and all
    (call,) = counting.generate_calls
    assert len(call["prompts"]) == 3 * 4 + 4 and call["layer"] == 0  # the frustration cell's rows alone
    assert again[1].d2.concept == "frustration" and store.exists(again[1].key)
    counting = Counting(worker)
    assert run_steering_cells(store, counting, [_cell(inputs, "frustration", 0)], inputs["scorers"], config) == \
        [again[1]]
    assert counting.generate_calls == [] and counting.nll_calls == []  # everything stored: nothing generates


def test_a_bad_cell_stops_the_group_before_anything_is_stored(worker, inputs, tmp_path):
    from poolbench.steerer.errors import SteeringError

    store = LocalStore(tmp_path / "store")
    bad = CellInputs("imdb_sentiment", "P1_last", 0, inputs["tables"]["imdb_sentiment"], ["x"])
    with pytest.raises(SteeringError, match="no pooled cell \\(layer 0, strategy 'P1_last'\\)"):
        run_steering_cells(store, worker, [_cell(inputs, "frustration", 0), bad], inputs["scorers"], _config(tmp_path))
    assert store.list("") == []


def test_distinct_rows_and_call_layers():
    a, b = np.ones(2, np.float32), np.full(2, 2.0)
    rows = [GenerationRow("p", None, 0, 0), GenerationRow("p", None, 0, 1),  # unsteered: any layer is the same row
            GenerationRow("p", a, 0, 0), GenerationRow("p", a.astype(np.float64), 0, 0),  # same float32 bytes
            GenerationRow("p", a, 0, 1), GenerationRow("p", a, 1, 0), GenerationRow("q", b, 0, 0)]
    distinct, index = distinct_rows(rows)
    assert index == [0, 0, 1, 1, 2, 3, 4] and len(distinct) == 5
    assert call_layers(distinct) == [0, 0, 1, 0, 0]
    assert call_layers([GenerationRow("p", None, 0, 3), GenerationRow("p", a, 0, 2)]) == 2
    assert call_layers([GenerationRow("p", None, 0, 3)]) == 3


def test_cells_are_grouped_per_engine_within_the_row_bound():
    cells = [SteeringCell(c, s, 1) for c in ("a", "b", "c") for s in ("A1", "P1")]
    # the default subset's 6 cells: one call on one engine; one share per engine on two
    assert cell_groups(cells, engines=1, per_call=18) == [tuple(cells)]
    assert cell_groups(cells, engines=2, per_call=18) == [tuple(cells[:3]), tuple(cells[3:])]
    # 7 cells, 3 a call: three calls of 2, 2 and 3 cells (balanced, in order), not 3, 3 and 1
    seven = [*cells, SteeringCell("d", "A1", 0)]
    assert [len(g) for g in cell_groups(seven, engines=1, per_call=3)] == [2, 2, 3]
    assert [g for group in cell_groups(seven, engines=1, per_call=3) for g in group] == seven
    assert cell_groups(cells[:2], engines=8, per_call=1) == [(cells[0],), (cells[1],)]
    assert cell_groups([], engines=2, per_call=3) == []
    # 10 alphas x 20 prompts + 20 prompted = 220 rows a cell; 4096 // 220 = 18 cells, and a prompt's rows of 18 cells
    # (1 + 18 x 9 = 163) fit one chunk of 256 rows.
    config = SteeringConfig(n_prompts=20)
    assert rows_per_cell(config) == 220 and cells_per_call(config) == 18
    assert cells_per_call(SteeringConfig(n_prompts=50)) == 4096 // 550  # 7
    small_chunks = SteeringConfig(n_prompts=20, settings=GenerationSettings(batch_size=64))
    assert cells_per_call(small_chunks) == (64 - 1) // 9  # 7: a prompt's 1 + 7 x 9 = 64 rows fill one chunk
    assert cells_per_call(SteeringConfig(n_prompts=50, settings=GenerationSettings(max_rows_per_call=10))) == 1


def test_progress_names_the_calls_first_cell_and_how_many_cells_it_holds(worker, monkeypatch, tmp_path):
    """While a group generates, the actor's progress() (polled from its second thread) names the group's first cell
    and its cell count, and the driver turns it into a CellProgress; between calls it answers None."""
    from poolbench.driver import steering_stage
    from poolbench.records.events import CellProgress
    from poolbench.steerer import actor
    from poolbench.steerer.transformers_backend import GenerationProgress

    service = actor.SteeringService(worker.loaded)
    seen: list = []
    step = GenerationProgress.step

    def polled(self, rows: int) -> None:
        step(self, rows)
        seen.append(service.progress())

    def run_cells(store, worker, inputs, scorers, config):  # the group's one generate call, nothing stored
        worker.generate_rows(PROMPTS * 3, layer=[c.layer for c in inputs for _ in PROMPTS] + [0] * 4,
                             deltas=[None] * 12, seeds=list(range(12)), settings=GenerationSettings(max_new_tokens=2))
        return []

    monkeypatch.setattr(GenerationProgress, "step", polled)
    monkeypatch.setattr(actor, "read_pooled_layer", lambda store, key, layer: None)
    monkeypatch.setattr(actor, "run_steering_cells", run_cells)
    cells = [SteeringCell("imdb_sentiment", "A1_mean", 1), SteeringCell("frustration", "P1_last", 0)]
    assert service.progress() is None
    service.run_cells(str(tmp_path / "store"), cells, {c: "pooled/x" for c in CONCEPTS}, {},
                      {c: ["x"] for c in CONCEPTS}, _config(tmp_path).to_record())
    assert service.progress() is None
    # 12 rows (one chunk) x 2 tokens: one poll per sampled step
    assert [(s["concept"], s["strategy"], s["layer"], s["cells"], s["tokens_done"], s["tokens_total"]) for s in seen] \
        == [("imdb_sentiment", "A1_mean", 1, 2, 12, 24), ("imdb_sentiment", "A1_mean", 1, 2, 24, 24)]
    events: list = []
    monkeypatch.setattr(steering_stage, "poll_actors", lambda actors: seen[:1])
    steering_stage.poll_steering([], events.append)
    assert events == [CellProgress("imdb_sentiment", "A1_mean", 1, 12, 24, seen[0]["seconds"], cells=2,
                                   worker_pid=os.getpid())]  # the service ran in this process


def test_the_actor_rebuilds_the_drivers_config_with_its_batching_settings(worker, tmp_path, monkeypatch):
    """Batching settings enter no key, so to_record drops them; the actor must still get them (to_message)."""
    from poolbench.steerer import actor

    settings = GenerationSettings(max_new_tokens=3, batch_size=5, token_budget=77, max_rows_per_call=9)
    config = replace(_config(tmp_path), settings=settings)
    got: list = []
    monkeypatch.setattr(actor, "read_pooled_layer", lambda store, key, layer: None)
    monkeypatch.setattr(actor, "run_steering_cells", lambda store, w, inputs, scorers, cfg: got.append(cfg) or [])
    service = actor.SteeringService(worker.loaded)
    service.run_cells(str(tmp_path / "store"), [SteeringCell("imdb_sentiment", "A1_mean", 1)],
                      {c: "pooled/x" for c in CONCEPTS}, {}, {c: ["x"] for c in CONCEPTS}, config.to_message())
    assert got == [config]
    assert SteeringConfig.from_message(config.to_record()).settings.batch_size == GenerationSettings().batch_size


@pytest.mark.numerics  # the prompted rows leave the call: bounded, and run on each kernel set
def test_without_the_prompted_baseline_cells_run_and_keep_their_steered_rows(worker, inputs, tmp_path):
    """prompted_baseline=False: each cell generates its alpha grid x prompts alone (2 cells of two concepts: the 4
    alpha = 0 rows once + 2 x 2 x 4 steered = 20 rows), stores no prompted rows or keys, and its steered rows and
    record are those of the same cell run with the baseline, less the prompted part."""
    config = replace(_config(tmp_path), prompted_baseline=False)
    assert rows_per_cell(config) == 3 * 4
    cells = [_cell(inputs, "imdb_sentiment", 0), _cell(inputs, "frustration", 1)]
    counting = Counting(worker)
    store = LocalStore(tmp_path / "off")
    without = run_steering_cells(store, counting, cells, inputs["scorers"], config)
    (call,) = counting.generate_calls
    assert len(call["prompts"]) == 4 + 2 * 2 * 4 and counting.nll_calls == [20]
    with_store = LocalStore(tmp_path / "on")
    with_baseline = run_steering_cells(with_store, worker, cells, inputs["scorers"], replace(config,
                                                                                              prompted_baseline=True))
    for off, on, cell in zip(without, with_baseline, cells, strict=True):
        assert off.d2.status == "ok" and off.d2.prompted_delta is None and off.d2.prompted_instruction is None
        assert not [k for k in off.to_dict()["d2"] if k.startswith("prompted_")]
        table = store.get_table(off.d2.generations_key)
        assert table.column("kind").to_pylist() == ["steered"] * 12
        assert table.column("alpha").to_pylist() == [0.0] * 4 + [0.5] * 4 + [2.0] * 4
        assert table.column("prompt").to_pylist() == PROMPTS * 3
        texts = table.column("text").to_pylist()
        # each row's score is its own text's (the scorer applied here, not read from the record)
        assert table.column(f"score_{cell.concept}").to_pylist() == \
            inputs["scorers"][cell.concept].score(texts).tolist()
        on_table = with_store.get_table(on.d2.generations_key)
        steered = [row for row in on_table.to_pylist() if row["kind"] == "steered"]
        assert [row["text"] for row in steered] == texts
        on_d2 = {k: v for k, v in _without_seconds(on)["d2"].items()
                 if not k.startswith("prompted_") and k != "generations_key"}
        off_d2 = {k: v for k, v in _without_seconds(off)["d2"].items() if k != "generations_key"}
        assert_records_close(off_d2, on_d2, rel=D2_REL, err_msg="d2 without the prompted rows")
        assert off.key != on.key  # the option enters the key: neither run reads the other's record
