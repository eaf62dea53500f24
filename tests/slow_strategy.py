"""A plugin strategy with A1_mean's weights that sleeps a while every batch: the tiny model pools a concept in 0.1 s,
faster than a removed node's processes stop or a probe task starts, so tests that need a job still running at some
event (a node removed mid-pool, a probe reporting beside the pooling) write this file and load it as a plugin."""

from __future__ import annotations

from pathlib import Path


def write_slow_mean(folder: Path, strategy_id: str, seconds: float) -> Path:
    """The plugin module registering `strategy_id` (code: its part before '_'); its path, for strategy_modules."""
    code = strategy_id.split("_", 1)[0]
    path = folder / f"slow_strategy_{code}.py"
    path.write_text(f'''
import time

import numpy as np

from poolbench.pooler.registry import register_strategy
from poolbench.pooler.spec import StrategySpec


def slow_mean(ctx):
    time.sleep({seconds!r})
    return np.ones(ctx.attention_mask.shape)


register_strategy(StrategySpec(id="{strategy_id}", code="{code}", family="other", kind="weights", weights_fn=slow_mean,
                               description="A1_mean that sleeps {seconds:g} s a batch."))
''')
    return path
