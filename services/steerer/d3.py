"""D3 arithmetic: does steering toward concept A leave its neighbours B alone (pure, no model)?

Delta_A is A's scorer change at alpha* on the report half; Delta_B is the neighbour's scorer change on the
very same texts. Disent = 1 - Delta_B / Delta_A, null when Delta_A's CI includes 0 (no effect to compare
against) or lies below 0, clipped to [0, 1] with the raw value kept. D3_rep, the cosine of two steering vectors,
is flagged when either vector's norm sits on a few massive-activation dimensions (Sun et al. 2024): the cosine
then compares those dimensions, not the concepts.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

import numpy as np

from .errors import SteeringError

D3_VERSION = 2  # 2: D3_rep's massive-dimension flag
MASSIVE_TOP_K = 3  # dimensions
MASSIVE_SHARE = 0.5  # of the squared norm: above it on MASSIVE_TOP_K dimensions, D3_rep is flagged


@cache
def neighbour_map() -> dict[str, dict[str, str]]:
    """{concept: {"LD": distant neighbour, "LC": close neighbour}} from the shipped data file."""
    raw = json.loads(resources.files("poolbench").joinpath("data/d3_neighbours.json").read_text("utf-8"))
    return {k: dict(v) for k, v in raw.items() if not k.startswith("_")}


def neighbours(concept: str) -> dict[str, str]:
    table = neighbour_map()
    if concept not in table:
        raise SteeringError(f"concept '{concept}' has no D3 neighbours (known: {', '.join(sorted(table))})")
    return table[concept]


def disentanglement(delta_a: float, ci_a: tuple[float | None, float | None], delta_b: float) -> dict:
    """{'disent': clipped or None, 'disent_raw': 1 - dB/dA or None, 'disent_null_reason': str or None}."""
    low, high = ci_a
    if low is None or high is None:
        return {"disent": None, "disent_raw": None, "disent_null_reason": "Delta_A has no confidence interval"}
    if low <= 0.0 <= high:
        return {"disent": None, "disent_raw": None,
                "disent_null_reason": f"Delta_A's CI [{low:.3g}, {high:.3g}] includes 0: no steering effect"}
    if high < 0.0:
        return {"disent": None, "disent_raw": None,
                "disent_null_reason": f"Delta_A's CI [{low:.3g}, {high:.3g}] is below 0: steering lowered A"}
    raw = 1.0 - delta_b / delta_a
    return {"disent": min(1.0, max(0.0, raw)), "disent_raw": raw, "disent_null_reason": None}


def massive_dimensions(vector: np.ndarray, top_k: int = MASSIVE_TOP_K) -> tuple[list[int], float]:
    """(the top_k dimensions by |value|, their share of the squared norm); share 0 for a zero vector."""
    v = np.asarray(vector, dtype=np.float64).ravel()
    total = float(v @ v)
    top = np.argsort(-np.abs(v), kind="stable")[:top_k]
    return sorted(int(i) for i in top), (float(np.sum(v[top] ** 2)) / total if total > 0 else 0.0)


def d3_rep_flags(u: np.ndarray | None, v: np.ndarray | None, *, top_k: int = MASSIVE_TOP_K,
                 share: float = MASSIVE_SHARE) -> dict:
    """D3_rep's massive-dimension diagnosis of two steering vectors: the larger top-k share of the two, the
    dimensions behind it, the flag (share > `share`), and the cosine with the union of both top-k sets removed."""
    if u is None or v is None:
        return {}
    (dims_u, share_u), (dims_v, share_v) = massive_dimensions(u, top_k), massive_dimensions(v, top_k)
    keep = np.ones(np.asarray(u).size, dtype=bool)
    keep[sorted(set(dims_u) | set(dims_v))] = False
    a, b = np.asarray(u, dtype=np.float64).ravel()[keep], np.asarray(v, dtype=np.float64).ravel()[keep]
    den = float(np.linalg.norm(a) * np.linalg.norm(b))
    return {"d3_rep_massive_share": max(share_u, share_v),
            "d3_rep_massive_dims": dims_u if share_u >= share_v else dims_v,
            "d3_rep_massive": max(share_u, share_v) > share,
            "d3_rep_without_massive": float(a @ b / den) if den > 0 else None}
