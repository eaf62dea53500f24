"""`run --seed` reaches the steering stage: prompt seeds, halves and bootstraps (D2/D3) and classifier B."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from poolbench.config import RunConfig
from poolbench.driver import steering_stage
from poolbench.steerer.plan import DEFAULT_RUN_CONFIG, FULL_N_PROMPTS, steering_config


def test_steering_config_carries_the_seed():
    assert steering_config(False).seed == 0 and steering_config(False) == DEFAULT_RUN_CONFIG
    seeded = steering_config(False, 7)
    assert seeded.seed == 7 and seeded.n_prompts == DEFAULT_RUN_CONFIG.n_prompts
    assert steering_config(True, 3).seed == 3 and steering_config(True, 3).n_prompts == FULL_N_PROMPTS


def test_the_run_seed_reaches_d2_d3_and_the_scorers(monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def ensure_scorers(store, corpus, concepts, config, **_):
        seen["scorer_seed"] = config.seed
        raise Stop

    monkeypatch.setattr(steering_stage, "ensure_scorers", ensure_scorers)
    monkeypatch.setattr(steering_stage, "choose_cells", lambda leaderboard, concepts, full: [])
    def config_of(full: bool, seed: int, reference_model: str):
        seen["steering_seed"] = seed
        return steering_config(full, seed, reference_model)

    monkeypatch.setattr(steering_stage, "steering_config", config_of)
    inputs = SimpleNamespace(store=None, store_url="unused", corpus=SimpleNamespace(concepts=[]))
    run = SimpleNamespace(plans=[])
    with pytest.raises(Stop):
        steering_stage.steer(RunConfig(seed=11), inputs, run, [], None, lambda event: None)
    assert seen == {"steering_seed": 11, "scorer_seed": 11}
