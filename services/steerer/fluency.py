"""D2's fluency guard, as controlled-generation work measures fluency without an LLM judge: a continuation's
perplexity under a separate reference model, unconditioned on its prompt (PPLM, Dathathri et al. 2020; DExperts,
Liu et al. 2021), and distinct-n against degenerate repetition (Li et al. 2016). Steering and prompting are held
to the same guard.

Why not the old guard (perplexity after the neutral prompt, under the unsteered model): that measures how far a
continuation strays from what the prompt leads the model to expect, so it penalises the concept shift itself; the
prompted baseline failed it on all three default concepts. A reference model reading the continuation alone asks
only whether it is likely text.

The thresholds, both applied to a set of continuations (one alpha's, or the prompted ones, on one prompt half):
- reference perplexity <= `guard` (2.0) x that of the unsteered (alpha = 0) continuations of the same prompts:
  the unsteered text is what this model writes when fluent, at the same sampling settings and length, so the
  ratio cancels the reference model's own scale (a 135M judge gives higher perplexities than a 7B one) and the
  length's; a factor 2 is a mean log-loss 0.69 nats per token above the model's own writing, where
  word-shuffling fluent text costs several times that (tests/test_fluency_guard.py).
- mean distinct-2 (the share of a continuation's word bigrams that are distinct) >= `min_distinct` (0.5): ordinary
  prose of the default length (24 tokens, ~18 words) repeats almost no word bigram (distinct-2 ~ 1); a
  continuation that loops over a phrase of p words scores about p / its length, so 0.5 means at most half the
  bigrams are repeats, which only a loop produces, while a repeated token scores ~0 (perplexity alone can miss
  it: a reference model grows confident in a loop).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import numpy as np

from poolbench.defaults import EMBEDDED, EMBEDDED_GEMMA

DEFAULT_FLUENCY_GUARD = 2.0  # max reference-perplexity ratio to alpha = 0 (the module docstring says why)
DEFAULT_MIN_DISTINCT = 0.5  # min mean distinct-2 of a set of continuations
DISTINCT_N = 2
AUTO = "auto"
SELF = "self"  # the steered model itself, unconditioned: for test models, never the default of a real run
REFERENCE_ENV = "POOLBENCH_FLUENCY_REFERENCE"  # overrides "auto" (tests set "self": no second model to load)
FLUENCY_MEASURE = "reference perplexity (unconditioned) ratio to alpha = 0, and distinct-2"
_WORD = re.compile(r"\w+|[^\w\s]")


def reference_model_for(model: str, option: str = AUTO) -> str:
    """The reference model that judges `model`'s continuations: `option` unless 'auto'; for 'auto' the other
    embedded model (SmolLM2-135M <-> Gemma-3-270M) and SmolLM2 for any other model, or $POOLBENCH_FLUENCY_REFERENCE."""
    if option != AUTO:
        return option
    if os.environ.get(REFERENCE_ENV):
        return os.environ[REFERENCE_ENV]
    return EMBEDDED_GEMMA if model == EMBEDDED else EMBEDDED


def distinct_n(text: str, n: int = DISTINCT_N) -> float:
    """Distinct n-grams over all n-grams of one text's words and punctuation (lower-cased); 0 when it has fewer
    than n of them: a continuation with no word boundary (one token repeated) shows no variety."""
    words = _WORD.findall(text.lower())
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def distinct_rows(texts: Sequence[str], n: int = DISTINCT_N) -> np.ndarray:
    return np.array([distinct_n(t, n) for t in texts], dtype=np.float64)


def passes_guard(ratio: float | None, distinct: float | None, *, guard: float = DEFAULT_FLUENCY_GUARD,
                 min_distinct: float = DEFAULT_MIN_DISTINCT) -> bool | None:
    """The one guard for steered and prompted continuations: None when the perplexity ratio is undefined; a
    missing distinct-2 (arrays built without texts) checks perplexity alone."""
    if ratio is None:
        return None
    return bool(ratio <= guard and (distinct is None or distinct >= min_distinct))
