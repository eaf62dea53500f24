"""bench/inflow_by_backward.py: the received attention as sdpa's values gradient equals attention_inflow's mean in
float32 to summation round-off, with and without padding, and its JSON carries both paths' seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from inflow_by_backward import compare  # noqa: E402


def test_the_values_gradient_is_todays_inflow_in_float32_grouped_heads_and_padding_included() -> None:
    # 9 query heads on 3 key heads, 64 tokens: each inflow is a sum of at most 64 float32 terms in another order,
    # so the two differ by at most 2 x 64 x 2^-24 of the sum (the terms are probabilities, all positive)
    bound = 2 * 64 * 2.0**-24
    for padded in (False, True):
        case = compare(3, (9, 3, 16), 64, torch.float32, "cpu", padded, repeats=1)
        assert case["max_relative_difference_where_inflow_over_1e-3_of_max"] <= bound, case
        assert case["max_abs_difference"] <= bound * case["max_inflow"], case
        assert case["padding_keys_candidate_max"] == 0.0  # a padding key receives nothing, not a rounded nothing


def test_a_bfloat16_candidate_moves_the_inflow_by_parts_in_2_to_the_9(tmp_path) -> None:
    """In the model's dtype the difference is the bound the bench exists to measure, not round-off: it must show."""
    out = tmp_path / "inflow.json"
    subprocess.run([sys.executable, str(BENCH / "inflow_by_backward.py"), "--device", "cpu", "--dtype", "bfloat16",
                    "--shape", "smollm2-135m", "--rows", "2", "--length", "64", "--repeats", "1", "--out", str(out)],
                   check=True, capture_output=True, cwd=BENCH)
    result = json.loads(out.read_text())
    assert result["benchmark"] == "inflow_by_backward" and result["device_name"] == "cpu"
    assert [c["padded"] for c in result["cases"]] == [False, True]
    for case in result["cases"]:
        assert case["seconds_today"] > 0 and case["seconds_candidate"] > 0
        assert 2.0**-12 < case["max_relative_difference_where_inflow_over_1e-3_of_max"] < 2.0**-4, case
