"""Held-out validity of a scorer: accuracy at 0.5 and AUROC with a pair-grouped bootstrap CI (pure)."""

from __future__ import annotations

import numpy as np

from poolbench.prober.auroc import auroc, bootstrap_auroc_ci


def held_out_validity(probs: np.ndarray, labels: np.ndarray, groups: np.ndarray, *,
                      n_bootstrap: int = 1000, seed: int = 0) -> dict:
    """Scores on the test split the scorer never trained on; groups keep a matched pair in one resample."""
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels, dtype=int)
    low, high = bootstrap_auroc_ci(probs, labels, groups, n_bootstrap=n_bootstrap, seed=seed)
    return {
        "heldout_accuracy": float(np.mean((probs >= 0.5) == (labels == 1))),
        "heldout_auroc": auroc(probs, labels),
        "heldout_auroc_ci_low": low,
        "heldout_auroc_ci_high": high,
        "n_heldout": int(labels.size),
    }
