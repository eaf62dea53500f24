"""D3 arithmetic: does steering toward concept A leave its neighbours B alone (pure, no model)?

Delta_A is A's scorer change at alpha* on the report half; Delta_B is the neighbour's scorer change on the
very same texts. Disent = 1 - Delta_B / Delta_A, null when Delta_A's CI includes 0 (no effect to compare
against) or lies below 0, clipped to [0, 1] with the raw value kept.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from .errors import SteeringError

D3_VERSION = 1


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
