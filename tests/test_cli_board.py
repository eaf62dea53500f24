"""The end of a run as a person reads it: the printed leaderboard's intervals and verdicts, the summary line,
in-concept progress, timestamped result files, load_results, and a light `import poolbench`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from poolbench.cli.board import leaderboard_table, summary_line
from poolbench.config import RunConfig
from poolbench.records.d1 import D1CellRecord
from poolbench.records.events import ConceptProgress
from poolbench.records.run import RunOutcome

CONCEPTS = ("c1", "c2", "c3")
# Per-concept held-out AUROC of three strategies; A's mean is 0.7 with sd 0.1 over 3 concepts:
# t(0.975, 2) = 4.302653, half-width 4.302653 * 0.1 / sqrt(3) = 0.24841 -> [0.452, 0.948].
D1 = {"A": (0.6, 0.7, 0.8), "B": (0.5, 0.7, 0.8), "C": (0.5, 0.5, 0.5)}


def board() -> dict:
    rows = []
    for rank, (strategy, values) in enumerate(D1.items(), start=1):
        rows.append({"strategy": strategy, "rank": rank, "mean_d1": sum(values) / 3,
                     "mean_cv_auroc": 0.8 if strategy == "B" else 0.75,
                     "best_layer": 2, "fallback_flagged_concepts": [],
                     "per_concept": {c: {"auroc": v, "ci_low": v - 0.1, "ci_high": min(1.0, v + 0.1),
                                         "cv_auroc": 0.8 if strategy == "B" else 0.75}
                                     for c, v in zip(CONCEPTS, values, strict=True)}})
    return {"probe": "logistic", "strategies": rows}


def rendered(leaderboard: dict, answer=None) -> str:
    console = Console(record=True, width=250, force_terminal=False)
    console.print(leaderboard_table(leaderboard, answer))
    return console.export_text()


def row_of(text: str, strategy: str) -> str:
    return next(line for line in text.splitlines() if f" {strategy} " in line)


def test_printed_leaderboard_shows_the_interval_and_each_verdict_from_the_answer():
    from poolbench.results.answer.answer import build_answer

    leaderboard = board()
    text = rendered(leaderboard, build_answer({"model": {"model_id": "m"}}, leaderboard))
    assert "0.700 [0.452, 0.948]" in row_of(text, "A")
    assert "c1 0.600 [0.500, 0.700]" in row_of(text, "A")  # the worst concept with its CI
    assert "chosen best" in row_of(text, "B")  # B has the higher mean CV AUROC, A the higher held-out mean
    assert "not separated" in row_of(text, "A") and "not separated" in row_of(text, "C")  # three concepts: never
    c_row = row_of(text, "C")
    assert "0.500 [0.500, 0.500]" in c_row  # no spread over concepts: a zero-width interval
    caption = " ".join(text.split())
    assert "Wilcoxon signed-rank over concepts with Holm's step-down (α = 0.05)" in caption and "tie" not in caption


def test_printed_leaderboard_without_an_answer_says_there_are_no_verdicts():
    none = rendered(board())
    assert "no verdicts (no answer)" in " ".join(none.split())
    assert "chosen best" not in none and "not separated" not in none


def test_summary_line_by_hand():
    from poolbench.results.answer.answer import build_answer

    leaderboard = board()
    answer = build_answer({"model": {"model_id": "m"}}, leaderboard)
    line = summary_line(leaderboard, total_s=42.4, results_path=Path("o/results.json"), answer=answer)
    # B (mean 2/3, sd 0.152753 over 3 concepts): half-width 4.302653 * 0.152753 / sqrt(3) = 0.379457, the
    # upper end clipped to the AUROC's 1.
    assert line == ("best (chosen on CV): B at layer 2, D1 0.667 [0.287, 1.000], one of "
                    f"{len(answer.verdicts.confidence_set)} in the confidence set for the best; 3 strategies x 3 "
                    "concepts in 42 s; results in o/results.json")
    assert "in 26.4 min" in summary_line(board(), total_s=1584.0, results_path=Path("r.json"))


def test_progress_event_eta_and_display():
    from rich.progress import Progress, TextColumn

    from poolbench.cli.run_display import RunDisplay
    from poolbench.records.events import RunPlanned

    event = ConceptProgress("hedging", batches=3, passages_done=24, passages_total=72, tokens_done=3984, seconds=6.0)
    assert event.eta_s == pytest.approx(12.0)  # 6 s for 24 passages: 48 left take 12 s
    assert ConceptProgress("x", 0, 0, 72, 0, 1.0).eta_s is None
    console = Console(record=True, width=200, force_terminal=False)
    with Progress(TextColumn("{task.fields[last]}"), console=console, auto_refresh=False) as progress:
        display = RunDisplay(progress)
        display.show(RunPlanned("tiny", 2, 32, ("hedging",), (0, 1), ("A1_mean",), (11,)))
        display.show(event)
        [pool] = [t for t in progress.tasks if t.description == "pool"]
        assert pool.fields["last"] == "hedging: 24/72 passages, 3 batches, 3,984 tokens, ETA 12s"
        # a job pooling several concepts in shared forwards names every one in flight
        display.show(ConceptProgress("hedging", 2, 40, 90, 5000, 4.0, group=("hedging", "toxicity", "contrast")))
    assert pool.completed == 0
    assert pool.fields["last"] == "hedging+toxicity+contrast: 40/90 passages, 2 batches, 5,000 tokens, ETA 5s"


def test_the_worker_reports_passages_and_tokens_after_every_batch(tiny_llama_dir, tmp_path, monkeypatch):
    """ExtractorWorker.progress() as the driver polls it, read after each batch: counts grow by the batch."""
    from poolbench.corpus.corpus_versions import generate_embedded_corpus
    from poolbench.pooler import worker as worker_module

    passages = generate_embedded_corpus("tiny")["hedging"][:10]
    worker = worker_module.ExtractorWorker(str(tiny_llama_dir), torch_threads=1)
    seen: list[dict] = []
    real = worker_module.pool_concept_group

    def spying(*args, on_batch, **kwargs):
        def watched(chunk, activations):
            on_batch(chunk, activations)
            seen.append(worker.progress())
        return real(*args, on_batch=watched, **kwargs)

    monkeypatch.setattr(worker_module, "pool_concept_group", spying)
    assert worker.progress() is None
    summary = worker.pool_concept("hedging", passages, [0], ["A1_mean"], store_url=str(tmp_path / "store"),
                                  key="pooled/x", metadata={}, batch_size=4, max_length=64)
    assert [s["passages_done"] for s in seen] == [4, 8, 10]
    assert [s["batches"] for s in seen] == [1, 2, 3]
    assert {s["passages_total"] for s in seen} == {10} and {s["concept"] for s in seen} == {"hedging"}
    assert all(s["concepts"] == ["hedging"] for s in seen)
    assert seen[-1]["tokens_done"] == summary["tokens"]
    assert worker.progress() is None  # idle again


def outcome(seed: int = 0) -> RunOutcome:
    records = [D1CellRecord(concept=c, layer=2, strategy=s, probe="logistic", cv_auroc=0.75, test_auroc=v,
                            ci_low=v - 0.1, ci_high=min(1.0, v + 0.1))
               for s, values in D1.items() for c, v in zip(CONCEPTS, values, strict=True)]
    return RunOutcome(config=RunConfig(seed=seed, steering=False), model={"model_id": "m"},
                      corpus={"hash": "h"}, layers=[2], strategies=[{"id": s, "family": "f"} for s in D1],
                      records=records, artifacts={}, timing={"total_s": 1.0})


def test_each_run_keeps_timestamped_files_and_results_json_is_the_latest(tmp_path):
    import poolbench
    from poolbench.results.documents.document import run_stamp, write_run_outputs

    assert run_stamp(__import__("datetime").datetime(2025, 6, 1, 14, 3, 9, 512345)) == "2025-06-01T14-03-09.512345"
    first = write_run_outputs(outcome(seed=1), tmp_path, stamp="2025-06-01T14-03-09.000001")
    second = write_run_outputs(outcome(seed=2), tmp_path, stamp="2025-06-01T15-00-00.000002")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["answer.json", "answer_2025-06-01T14-03-09.000001.json", "answer_2025-06-01T15-00-00.000002.json",
                     "leaderboard.json", "leaderboard_2025-06-01T14-03-09.000001.json",
                     "leaderboard_2025-06-01T15-00-00.000002.json", "leaderboard_long.csv", "leaderboard_wide.csv",
                     "results.json",
                     "results_2025-06-01T14-03-09.000001.json", "results_2025-06-01T15-00-00.000002.json"]
    assert json.loads(first["results_stamped"].read_text())["seed"] == 1
    assert json.loads(second["results"].read_text()) == json.loads(second["results_stamped"].read_text())
    assert json.loads(second["results"].read_text())["seed"] == 2

    latest = poolbench.load_results(tmp_path)
    assert latest.document["seed"] == 2 and latest.paths["leaderboard"] == tmp_path / "leaderboard.json"
    assert latest.best["strategy"] == "A" and latest.mean_d1() == pytest.approx({"A": 0.7, "B": 2 / 3, "C": 0.5})
    assert len(latest.cells) == 9 and all(isinstance(c, D1CellRecord) for c in latest.cells)
    older = poolbench.load_results(first["results_stamped"])
    assert older.document["seed"] == 1
    assert older.paths["leaderboard"] == first["leaderboard_stamped"]


def test_load_results_stops_in_one_line_on_a_missing_or_broken_run(tmp_path):
    import poolbench
    from poolbench.errors import PoolBenchError

    with pytest.raises(PoolBenchError, match=r"no results\.json in"):
        poolbench.load_results(tmp_path)
    (tmp_path / "results.json").write_text("{not json")
    with pytest.raises(PoolBenchError, match="is not valid JSON"):
        poolbench.load_results(tmp_path)


def test_import_poolbench_stays_light():
    """The root import must not pull torch or Ray (notebooks, `load_results`, tools that only read results)."""
    code = ("import sys, poolbench; assert callable(poolbench.load_results); "
            "print(sorted(m for m in ('torch', 'ray', 'transformers', 'matplotlib') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        __import__("poolbench").nope  # noqa: B018
