"""bench/generate.py runs end to end on CPU: a --shape model built from the embedded tokenizer, every
transformers arm (the cells arms too), and the JSON the GPU results are committed in (device, git, shape, arms,
identical rows, cells)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import generate  # bench/ holds scripts, not a package


def test_generate_bench_smoke(tmp_path):
    out = tmp_path / "generate.json"
    result = generate.main(["--shape", "smoke", "--device", "cpu", "--prompts", "3", "--max-new-tokens", "3",
                            "--cells", "2", "--repeats", "1", "--threads", "1", "--out", str(out)])
    stored = json.loads(out.read_text())
    assert stored["shape"] == "smoke" and stored["device"] == "cpu" and stored["dtype"] == "float32"
    assert stored["git"] == result["git_hash"]
    assert set(stored["arms"]) == {"hf_generate", "transformers_backend", "transformers_per_alpha",
                                   "transformers_cells_one_call", "transformers_cells_per_cell"}
    rows = len(stored["alphas"]) * 3
    # 2 cells of one concept (at the middle layer and the next; the smoke shape's 2 layers leave only layer 1):
    # 10 alphas x 3 prompts + 3 prompted each = 66 rows; distinct: 3 alpha = 0 rows, 2 x 9 x 3 steered, 3 prompted.
    assert stored["cells"] == {"n": 2, "layers": [1], "rows": 66, "distinct_rows": 60}
    for name, a in stored["arms"].items():
        # EOS suppressed: every row writes max_new_tokens; the cells arms answer every cell's 66 rows
        assert a["tokens"] == (66 if "cells" in name else rows) * 3, name
        assert a["tokens_per_s"] > 0
    ident = stored["identical_rows"]["transformers_grid_vs_per_alpha"]
    # fp32 on CPU: a row's continuation does not depend on the rest of its batch.
    assert ident == {"identical": rows, "rows": rows, "rate": 1.0}
    assert stored["identical_rows"]["transformers_cells_one_call_vs_per_cell"] == {"identical": 66, "rows": 66,
                                                                                   "rate": 1.0}
    assert stored["ratios"]["transformers_cells_one_call_over_per_cell"] > 0


def test_the_as_shipped_engine_starts_with_the_backends_openmp_binding(monkeypatch):
    """The as-shipped arm's engine reads VLLM_CPU_OMP_THREADS_BIND when it starts; without the backend's binding
    vLLM picks its own (one core of two here) and the arm ran at half the backend's threads (bench/README.md)."""
    import os

    import pytest
    import torch

    vllm = pytest.importorskip("vllm")
    from poolbench.steerer.vllm_engine import THREADS_ENV, cpu_thread_bind

    seen: dict = {}

    class Started(Exception):
        pass

    def fake_llm(**kwargs):
        seen.update(bind=os.environ.get(THREADS_ENV), kwargs=kwargs)
        raise Started

    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.setattr(vllm, "LLM", fake_llm)
    with pytest.raises(Started):
        generate.as_shipped("model-path", "float32", 512, 0.5, "cpu")
    assert seen["bind"] == cpu_thread_bind(torch.get_num_threads(), os.sched_getaffinity(0))
    assert seen["kwargs"]["enable_chunked_prefill"] is False
