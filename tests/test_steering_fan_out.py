"""Several steering engines: the driver's work queue fans (concept, layer) cells across steering actors. On CPU,
two transformers-backend actors on a local Ray split the cells and answer exactly what one actor answers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from poolbench.driver.work_queue import ActorJob, WorkQueue
from poolbench.steerer.actor import actor_count, steering_actors
from poolbench.steerer.backend import GenerationSettings
from poolbench.steerer.run import prompt_seeds

PROMPTS = ["the cat sat on", "a dog", "birds sang in the trees"]
CELLS = [(concept, layer) for concept in ("praise", "hedging", "toxicity") for layer in (0, 1)]
SETTINGS = GenerationSettings(max_new_tokens=4)


def _cell_rows(cell: tuple[str, int], d: int) -> list[np.ndarray | None]:
    """A cell's alpha grid (0, 20, 40) along a direction of its own."""
    rng = np.random.default_rng(CELLS.index(cell))
    unit = rng.normal(size=d).astype(np.float32)
    unit /= np.linalg.norm(unit)
    return [None if a == 0 else (a * unit).astype(np.float32) for a in (0.0, 20.0, 40.0) for _ in PROMPTS]


def _fan_out(actors, d: int) -> tuple[dict, dict]:
    """Every cell's generations through the queue, and which actor ran each cell."""
    ran_on: dict = {}

    def job(cell):
        def call(actor):
            ran_on[cell] = actors.index(actor)
            return actor.generate_rows.remote(PROMPTS * 3, layer=cell[1], deltas=_cell_rows(cell, d),
                                              seeds=prompt_seeds(len(PROMPTS), 0) * 3, settings=SETTINGS)
        return ActorJob(cell, call)

    with WorkQueue(actors) as queue:
        results = {cell: [g.token_ids for g in gens] for cell, gens in queue.run([job(c) for c in CELLS])}
    return results, ran_on


def test_actor_count_follows_gpus_and_tensor_parallelism():
    assert actor_count(8, 1, None) == 8 and actor_count(8, 2, None) == 4 and actor_count(8, 1, 3) == 3
    assert actor_count(1, 2, None) == 1  # a model wider than the cluster still gets its one engine
    assert actor_count(0, 1, None) == 1 and actor_count(0, 1, 2) == 2


@pytest.mark.slow
def test_two_actors_split_the_cells_and_answer_as_one_does(tiny_llama_dir: Path, local_ray):
    import ray

    two = steering_actors(str(tiny_llama_dir), n=2, device="cpu", torch_threads=1)
    d = ray.get(two[0].info.remote())["hidden_size"]
    split, ran_on = _fan_out(two, d)
    one, _ = _fan_out(steering_actors(str(tiny_llama_dir), n=1, device="cpu", torch_threads=1), d)
    assert sorted(set(ran_on.values())) == [0, 1]  # both actors ran cells
    assert split == one
    # Cells differ (different directions and layers), so equal answers are not one answer copied.
    assert len({tuple(v) for v in split.values()}) > 1
