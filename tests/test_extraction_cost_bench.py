"""bench/extraction_cost.py --shape tiny runs end to end on CPU and writes the fields a GPU result file carries."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "bench" / "extraction_cost.py"


def test_the_shape_bench_writes_device_versions_ratios_and_the_seconds_split(tmp_path) -> None:
    out = tmp_path / "cost.json"
    subprocess.run([sys.executable, str(BENCH), "--shape", "tiny", "--texts", "2", "--max-length", "48",
                    "--repeats", "1", "--threads", "1", "--device", "cpu", "--in-process", "--out", str(out)],
                   check=True, cwd=BENCH.parent, capture_output=True)
    result = json.loads(out.read_text())
    assert result["shape"] == "tiny" and result["device"] and result["git"]
    assert result["torch"] and result["cuda"] is None and result["pooling"] == "device"
    assert set(result["ratios"]) == {"hidden_vs_forward", "attention_vs_forward", "all_vs_fwd_bwd",
                                     "fwd_bwd_vs_forward"}
    assert all(math.isfinite(v) and v > 0 for v in result["ratios"].values())
    assert set(result["tokens_per_s"]) == {"raw", "forward_backward", "hidden", "attention", "gradient", "all"}
    assert all(v > 0 for v in result["peak_device_bytes"].values())
    for stage in ("hidden", "attention", "gradient", "all"):
        split = result["seconds_split"][stage]
        assert set(split) == {"forward_s", "pooling_s", "device_to_host_s", "host_s", "prepare_s"}
        assert split["forward_s"] > 0 and split["pooling_s"] > 0 and split["device_to_host_s"] >= 0


def test_the_bench_pools_several_concepts_per_job_with_the_next_chunk_prepared_ahead(tmp_path) -> None:
    out = tmp_path / "cost.json"
    subprocess.run([sys.executable, str(BENCH), "--shape", "tiny", "--concepts", "3", "--texts", "3",
                    "--concepts-per-job", "3", "--overlap", "on", "--batch-size", "4", "--stages", "raw,hidden",
                    "--max-length", "48", "--repeats", "1", "--threads", "1", "--device", "cpu", "--in-process",
                    "--out", str(out)], check=True, cwd=BENCH.parent, capture_output=True)
    result = json.loads(out.read_text())
    assert result["concepts_per_job"] == 3 and result["overlap"] == "on"
    hidden = result["stages"]["hidden"]
    # 9 passages in one job: batches of 4, 4 and 1 rows, where one job per concept would run 3 x (3 rows)
    assert result["forwards"] == {"raw": 3, "hidden": 3} and hidden["prepared_ahead"] == 2
    assert hidden["forward_padded_tokens"] == result["stages"]["raw"]["forward_padded_tokens"]
    assert result["seconds_split"]["hidden"]["prepare_s"] > 0
