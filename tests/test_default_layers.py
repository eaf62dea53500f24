"""Which layers a run probes when --layers is not given: all of a shallow model, six spread over a deep one."""

from __future__ import annotations

import pytest

from poolbench.config import RunConfig
from poolbench.config import parse_layers as _layers
from poolbench.driver.pipeline import default_layers


@pytest.mark.parametrize("n,expected", [
    (2, [0, 1]), (4, [0, 1, 2, 3]), (6, [0, 1, 2, 3, 4, 5]),
    (30, [0, 6, 12, 17, 23, 29]),  # SmolLM2-135M: i * 29 / 5 rounded
    (32, [0, 6, 12, 19, 25, 31]),  # Llama-3.1-8B
])
def test_default_layers_by_hand(n, expected):
    assert default_layers(n) == expected


def test_layers_option_takes_indices_all_or_nothing():
    assert _layers(["4,16", "28"]) == (4, 16, 28)
    assert _layers(["all"]) == "all"
    assert _layers(None) is None
    assert RunConfig(layers="all").layers == "all"
    with pytest.raises(ValueError):
        RunConfig(layers="some")
