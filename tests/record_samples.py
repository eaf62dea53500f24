"""Typed records for tests that exercise readers: every required field filled, overrides on top."""

from __future__ import annotations

from poolbench.records.scorer import ScorerValidity
from poolbench.records.steering import D2Record, D3Record


def d2_record(**fields) -> D2Record:
    """An 'ok' D2 cell of a tiny run unless `fields` say otherwise."""
    base = {"concept": "a", "strategy": "A1_mean", "layer": 0, "model_id": "tiny", "backend": "transformers",
            "vector_norm": 1.0, "residual_norm": 10.0, "vector_null_reason": None, "n_prompts": 4,
            "alphas": [0.0, 1.0], "scorer_key": "scorer/a", "scorer_heldout_auroc": 0.9, "gen_max_new_tokens": 8,
            "gen_min_new_tokens": 8, "gen_temperature": 0.7, "gen_greedy": False, "status": "ok",
            "null_reason": None, "scp": 0.5, "d2_delta": 0.1}
    return D2Record.from_dict({**base, **fields})


def d3_record(**fields) -> D3Record:
    base = {"concept": "a", "strategy": "A1_mean", "layer": 0, "model_id": "tiny", "backend": "transformers",
            "neighbour": "b", "relation": "LD", "disent": None, "disent_raw": None,
            "disent_null_reason": "Delta_A has no confidence interval", "d3_rep": None}
    return D3Record.from_dict({**base, **fields})


def scorer_validity(**fields) -> ScorerValidity:
    base = {"concept": "a", "encoder": "minilm", "encoder_hash": "e0", "fine_tuned": "top 1 of 6 blocks",
            "trained_params": 10, "total_params": 100, "n_train": 40, "n_heldout": 20, "heldout_accuracy": 0.85,
            "heldout_auroc": 0.9, "heldout_auroc_ci_low": 0.85, "heldout_auroc_ci_high": 0.95, "valid": True,
            "train_seconds": 1.5, "key": "scorer/a", "min_auroc": 0.7}
    return ScorerValidity.from_dict({**base, **fields})
