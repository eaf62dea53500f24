"""A constructed matched-pair corpus for pooling and probing tests: "if ... not" against "... sun"."""

from __future__ import annotations

import numpy as np

from poolbench.corpus.passage import Passage

WORDS = ["the", "river", "cat", "sat", "if", "rain", "falls", "we", "stay", "home", "not", "never", "sun"]


def passages(n_pairs: int, split: str) -> list[Passage]:
    rng = np.random.default_rng(len(split))
    out = []
    for i in range(n_pairs):
        base = " ".join(rng.choice(WORDS, size=6))
        for label, text in ((1, f"if {base} not"), (0, f"{base} sun")):
            out.append(Passage(f"{split}{i}-{label}", text, label, "d", 8, f"{split}{i}", split, "negation"))
    return out
