"""Near-ties: a CV-chosen layer whose margin over the runner-up is a few opposite-label pairs' order, which float
round-off on another CPU (another kernel set, thread count or batch chunking) may flip. The run names such a choice
(docs/reproducibility.md) instead of letting it flip silently from one machine to the next; it never changes it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

# A choice is near-tied when this many pair orders, each at the largest step one pair can make in the mean over
# concepts, could close its margin: one pair in the best layer's scores and one in the runner-up's. A convention
# (pair orders flip only where two scores tie within round-off), not a measured rate.
NEAR_TIE_PAIRS = 2


def cv_auroc_step(n_train: int, n_folds: int) -> float:
    """The change one opposite-label pair's order makes in a CV AUROC (the mean of fold AUROCs): a matched pair
    keeps both its passages in one fold, so a fold holds n_train/(2·n_folds) of each label, and one pair moves
    that fold's AUROC by 1/(per-class count)² and the mean by 1/n_folds of that."""
    if n_train < 2 or n_folds < 1:
        raise ValueError(f"n_train must be >= 2 and n_folds >= 1, got {n_train} and {n_folds}")
    per_class = n_train / (2 * n_folds)
    return 1.0 / (n_folds * per_class**2)


@dataclass(frozen=True)
class LayerNearTie:
    """The runner-up layer, the chosen layer's margin over it (mean CV AUROC), and the margin NEAR_TIE_PAIRS pair
    orders could close."""

    runner_up: int
    margin: float
    pairs_could_close: float

    def to_dict(self) -> dict:
        return asdict(self)


def layer_near_tie(curve: Mapping[int, float], best: int, steps: Mapping[str, float]) -> LayerNearTie | None:
    """The near-tie of `best` on a layer curve (mean CV AUROC over concepts per layer), given each concept's
    cv_auroc_step; None when no other layer was probed or the margin is wider than NEAR_TIE_PAIRS pairs."""
    others = {layer: value for layer, value in curve.items() if layer != best}
    if not others or not steps:
        return None
    runner_up = max(sorted(others), key=lambda layer: others[layer])
    margin = float(curve[best] - others[runner_up])
    could_close = NEAR_TIE_PAIRS * max(steps.values()) / len(steps)
    return LayerNearTie(int(runner_up), margin, could_close) if margin <= could_close else None


def near_tie_sentence(strategy: str, layer: int, tie: Mapping[str, float]) -> str:
    """One line a findings reader can act on: the choice, its runner-up, and why it may differ on another CPU."""
    return (f"{strategy}: layer {layer} is chosen over layer {int(tie['runner_up'])} by {tie['margin']:.4f} mean CV "
            f"AUROC, within the {tie['pairs_could_close']:.4f} that {NEAR_TIE_PAIRS} pairs' order can close: a near-"
            f"tie, which another CPU's round-off may resolve the other way.")


def layer_text(row: Mapping) -> str:
    """A leaderboard row's chosen layer as a table shows it: "14", or "14 (near-tie: 7)" when layer_near_tie is set."""
    tie = row.get("layer_near_tie")
    return f"{row['best_layer']}" + (f" (near-tie: {int(tie['runner_up'])})" if tie else "")
