"""bench/generate.py runs end to end on CPU: a --shape model built from the embedded tokenizer, every
transformers arm, and the JSON the GPU results are committed in (device, git, shape, arms, identical rows)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import generate  # bench/ holds scripts, not a package


def test_generate_bench_smoke(tmp_path):
    out = tmp_path / "generate.json"
    result = generate.main(["--shape", "smoke", "--device", "cpu", "--prompts", "3", "--max-new-tokens", "3",
                            "--repeats", "1", "--threads", "1", "--out", str(out)])
    stored = json.loads(out.read_text())
    assert stored["shape"] == "smoke" and stored["device"] == "cpu" and stored["dtype"] == "float32"
    assert stored["git"] == result["git_hash"]
    assert set(stored["arms"]) == {"hf_generate", "transformers_backend", "transformers_per_alpha"}
    rows = len(stored["alphas"]) * 3
    for name, a in stored["arms"].items():
        assert a["tokens"] == rows * 3, name  # EOS suppressed: every row writes max_new_tokens
        assert a["tokens_per_s"] > 0
    ident = stored["identical_rows"]["transformers_grid_vs_per_alpha"]
    # fp32 on CPU: a row's continuation does not depend on the rest of its batch.
    assert ident == {"identical": rows, "rows": rows, "rate": 1.0}
