"""What `make run` runs (`poolbench-driver run`, D1 and then D2/D3 on the default steering subset), end to
end on the tiny test model; every other pipeline and CLI test passes --no-steering."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DRIVER = [sys.executable, "-c", "from poolbench.cli.app import main; main()"]
CONCEPTS = ("imdb_sentiment", "frustration")  # two default steering concepts, each the other's neighbour


def test_run_with_steering_writes_d2_and_d3(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = subprocess.run(
        [*DRIVER, "run", "--model", str(tiny_llama_dir), "--corpus-size", "tiny", "--concepts", ",".join(CONCEPTS),
         "--strategies", "A1_mean,P1_last,W2_last_k", "--n-bootstrap", "100", "--torch-threads", "1",
         "--store", str(tmp_path / "store"), "--out", str(out), "--allow-weak-scorer", "--log-samples"],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "POOLBENCH_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    leaderboard = json.loads((out / "leaderboard.json").read_text())

    fingerprints = {s["id"]: s["params"] for s in results["strategies"]}
    assert fingerprints["A1_mean"] == {"sink": "auto"} and fingerprints["P1_last"] == {}
    assert results["steering"]["subset"] == "default"
    assert results["steering"]["steering_config"]["alphas"] == [0.0, 0.05, 0.07, 0.1, 0.14, 0.2, 0.28, 0.4, 0.57, 0.8]
    assert results["steering"]["steering_config"]["prompt_format"] == "auto"
    assert {r["concept"] for r in results["scorers"]} == set(CONCEPTS)
    # the default corpus's tiers: D1 per tier for each unsupervised strategy, the lexical baseline per tier
    assert {(r["strategy"], r["tier"]) for r in results["d1_by_tier"]} == {
        (s, t) for s in ("A1_mean", "P1_last", "W2_last_k") for t in ("standard", "hard")}
    assert all(r["n"] == 2 * 2 * 8 for r in results["d1_by_tier"] if r["tier"] == "hard")  # 2 concepts x 8 pairs
    assert leaderboard["by_tier"]["hard"]["lexical"]["max"] <= 0.65

    d2 = results["d2"]
    # per concept: the best strategy chosen on CV (the answer's, not the held-out leader) and the worst above
    # chance (or the worst at all), at their D1 layers
    assert sorted(r["concept"] for r in d2) == sorted(CONCEPTS * 2)
    best = leaderboard["best_on_cv"]
    assert {r["strategy"] for r in d2 if r["selected_because"] == "best D1"} == {best}
    for r in d2:
        assert r["prompt_format"] == "plain"  # the tiny tokenizer has no chat template
        assert r["n_prompts"] == 20 and r["gen_max_new_tokens"] == 24 and r["gen_min_new_tokens"] == 24
        assert r["status"] == "ok", r.get("null_reason")
        assert r["alphas"] == [0.0, 0.05, 0.07, 0.1, 0.14, 0.2, 0.28, 0.4, 0.57, 0.8] and len(r["per_alpha"]) == 10
        assert r["per_alpha"][0]["fluency_ratio"] == 1.0  # alpha = 0 against itself
        assert r["alpha_star"] in r["alphas"] and -1.0 <= r["scp"] <= 1.0
        assert r["residual_norm"] > 0 and r["prompted_instruction"]
        assert sorted(r["select_prompts"] + r["report_prompts"]) == list(range(20))

    d3 = {(r["concept"], r["strategy"], r["neighbour"]): r for r in results["d3"]}
    assert len(d3) == 8  # 4 cells x 2 neighbours
    for (_, _, neighbour), r in d3.items():
        if neighbour in CONCEPTS:  # imdb_sentiment <-> frustration: scored by the neighbour's classifier
            assert r["delta_b"] is not None and -1.0 <= r["d3_rep"] <= 1.0
        else:
            assert r["delta_b"] is None and r["disent_null_reason"] == f"no scorer for neighbour '{neighbour}'"
    assert set(leaderboard["steering"]) == {r["strategy"] for r in d2}
    assert sum(s["n_cells"] for s in leaderboard["steering"].values()) == 4

    # --log-samples: every generation of every D2 cell (10 alphas x 20 prompts + 20 prompted), with its scores
    (generations,) = out.glob("generations_*.jsonl")
    rows = [json.loads(line) for line in generations.read_text().splitlines()]
    assert len(rows) == len(d2) * (10 * 20 + 20)
    for r in d2:
        key = (r["concept"], r["strategy"], r["layer"])
        steered = [g for g in rows if (g["concept"], g["strategy"], g["layer"]) == key and g["kind"] == "steered"]
        assert sorted({g["alpha"] for g in steered}) == r["alphas"] and len(steered) == 200
        # the report half's mean score at alpha = 0 is the record's per_alpha[0] score
        at_zero = [g["scores"][r["concept"]] for g in steered
                   if g["alpha"] == 0.0 and g["prompt_index"] in r["report_prompts"]]
        assert abs(sum(at_zero) / len(at_zero) - r["per_alpha"][0]["score"]) < 1e-9
