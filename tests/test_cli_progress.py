"""Piped output of a run: one plain line per stage step with counts and an ETA, no bars, no ANSI, no \\r."""

from __future__ import annotations

import io

from poolbench.cli.progress import LineProgress
from poolbench.cli.run_display import RunDisplay
from poolbench.records.events import ConceptPooled, ConceptProbed, ConceptProgress, LayerProbed, RunPlanned


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_run_events_become_plain_lines_with_counts_and_eta():
    stream, clock = io.StringIO(), Clock()
    display = RunDisplay(LineProgress(stream, step_pct=25, detail_every_s=30, clock=clock))
    concepts = tuple(f"c{i}" for i in range(8))
    display.show(RunPlanned(model_id="m", n_layers=4, hidden_size=8, concepts=concepts, layers=(0, 1),
                            strategies=("A1_mean",), worker_pids=(1,)))
    for i, concept in enumerate(concepts):
        clock.now += 10.0
        display.show(ConceptProgress(concept=concept, batches=1, passages_done=5, passages_total=10,
                                     tokens_done=100, seconds=1.0))
        display.show(ConceptPooled(concept=concept, skipped=i == 0, seconds=10.0))
    display.show(ConceptProbed(concept="c0", skipped=False))
    assert "probe D1" not in stream.getvalue()  # 1/8 is below the first 25% step
    clock.now += 20.0
    display.show(ConceptProbed(concept="c1", skipped=True))
    text = stream.getvalue()
    assert "\x1b" not in text and "\r" not in text
    pool = [line for line in text.splitlines() if line.startswith("pool:")]
    # 8 concepts, a line at each 25% step: 2/8, 4/8, 6/8, 8/8; details only every 30 s (t = 10, 40, 70)
    counted = [line for line in pool if "%)" in line]
    assert [line.split(" (")[0] for line in counted] == ["pool: 2/8", "pool: 4/8", "pool: 6/8", "pool: 8/8"]
    assert "20s elapsed, ETA 60s" in counted[0]  # 2 done in 20 s, 6 to go at 10 s each
    assert "done in 80s" in counted[-1]
    assert len(pool) - len(counted) == 3
    # The probes began at t = 80 (the first done), one more in 20 s: 6 to go at 20 s each, not at 100 s / 2 (5.0min)
    assert "probe D1: 2/8 (25%), 1.7min elapsed, ETA 2.0min · c1 (cached)" in text
    assert text.splitlines()[0].startswith("model m (4 layers, d=8), 8 concepts")


def test_a_run_with_other_sites_and_lengths_counts_every_concept_pass():
    """--sites residual,attn --context-lengths 1,4 pools every concept three times: the bars count 6 passes for
    2 concepts and end at 6/6 (they read 3/2 (150%) when the total was the concepts alone)."""
    stream = io.StringIO()
    display = RunDisplay(LineProgress(stream, step_pct=50, detail_every_s=1e9, clock=Clock()))
    display.show(RunPlanned(model_id="m", n_layers=4, hidden_size=8, concepts=("a", "b"),
                            strategies=("A1_mean",), worker_pids=(1,), variants=("main", "attn", "k4"), layers=(17,)))
    for _ in range(3):
        for concept in ("a", "b"):
            display.show(ConceptPooled(concept=concept, skipped=False, seconds=1.0))
    text = stream.getvalue()
    assert "layers [17], 1 strategies, 1 worker(s), passes main, attn, k4" in text.splitlines()[0]  # not "layers ,"
    counted = [line.split(" (")[0] for line in text.splitlines() if line.startswith("pool:") and "%)" in line]
    assert counted == ["pool: 3/6", "pool: 6/6"]


def test_the_steering_engines_start_up_is_one_line():
    """--backend vllm: each engine's mode and start-up (load, compile, capture) once; transformers actors: nothing."""
    from poolbench.records.events import SteeringStarted

    stream = io.StringIO()
    display = RunDisplay(LineProgress(stream, step_pct=25, detail_every_s=30, clock=Clock()))
    display.show(SteeringStarted(worker_pids=(1,), nodes=("n",)))
    display.show(SteeringStarted(worker_pids=(1, 2), nodes=("n",), engines=(
        "vLLM compiled, started in 95.2 s", "vLLM compiled, started in 97.0 s")))
    assert stream.getvalue() == ("steering engines: vLLM compiled, started in 95.2 s; vLLM compiled, started in "
                                 "97.0 s\n")


def test_a_probed_layer_moves_the_d1_line_without_counting_a_concept():
    """LayerProbed (one layer's D1 task back) is the probe line's detail, at most every detail_every_s, and does
    not advance it: the count is concepts."""
    stream, clock = io.StringIO(), Clock()
    display = RunDisplay(LineProgress(stream, step_pct=50, detail_every_s=30, clock=clock))
    display.show(RunPlanned(model_id="m", n_layers=32, hidden_size=8, concepts=("c0", "c1"), layers=(0, 6),
                            strategies=("A1_mean",), worker_pids=(1,)))
    clock.now += 40.0
    display.show(LayerProbed(concept="c0", layer=6, cells=38, read_s=0.4, probe_s=2.46, write_s=0.1))
    assert "probe D1: 0/2 · c0 layer 6: 38 cells in 2.5s" in stream.getvalue()
    clock.now += 1.0
    display.show(LayerProbed(concept="c0", layer=0, cells=38, read_s=0.4, probe_s=3.0, write_s=0.1))
    assert "layer 0" not in stream.getvalue()  # a second detail within 30 s is not printed
    display.show(ConceptProbed(concept="c0", skipped=False))
    assert "probe D1: 1/2 (50%)" in stream.getvalue()
