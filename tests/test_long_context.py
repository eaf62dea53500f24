"""The length axis. A passage read inside k x its length of neutral text keeps its own text at a recorded span, the
same every time. On a constructed corpus where one token in a passage carries the concept, a probe trained at
length 1 and read at length 4 loses D1 with mean pooling (the signal is diluted 4 times while the noise mean's
spread only halves) and keeps it with max pooling (the signal token still tops the max): the should-fail pair.
Expected from the arithmetic (one +6 token among n unit-normal tokens, AUROC = Phi(d'/sqrt 2)): mean pooling
d' = (6/n)·sqrt(n) = 2.12 at n = 8 (AUROC 0.93) and 1.06 at n = 32 (0.77); max pooling: the token (6 ± 1) against
the max of 32 normals (≈ 2.0 ± 0.5) stays above 0.99. 80 test passages put an AUROC's standard error near 0.03."""

from __future__ import annotations

import numpy as np

from poolbench.corpus.long_context import in_context
from poolbench.corpus.passage import Passage
from poolbench.prober.d1 import evaluate_d1

PASSAGE = Passage("p1", "If the rain falls we will not stay home tonight.", 1, "d", 12, "g1", "test", "negation")


def test_a_passage_in_context_keeps_its_text_at_its_span_reproducibly() -> None:
    long = in_context(PASSAGE, 4, seed=0)
    (start, end), = long.signal_spans
    assert long.text[start:end] == PASSAGE.text and long.id == "p1@k4"
    assert 3 * len(PASSAGE.text.split()) <= len(long.text.split()) <= 6 * len(PASSAGE.text.split())
    assert in_context(PASSAGE, 4, seed=0) == long and in_context(PASSAGE, 4, seed=1).text != long.text
    assert long.placement in ("start", "middle", "end") and long.label == 1 and long.split == "test"
    assert in_context(PASSAGE, 1) is PASSAGE


def _pooled(n_pairs: int, length: int, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Mean- and max-pooled vectors of passages of `length` noise tokens in d=4; positives hold one token at +6
    along dimension 0 (pairs: a positive and its negative share a group)."""
    means, maxes = [], []
    for i in range(2 * n_pairs):
        tokens = rng.normal(size=(length, 4))
        if i % 2 == 0:
            tokens[rng.integers(length), 0] += 6.0
        means.append(tokens.mean(axis=0))
        maxes.append(tokens.max(axis=0))
    return {"mean": np.array(means), "max": np.array(maxes)}, np.tile([1, 0], n_pairs)


def test_mean_pooling_loses_d1_with_length_and_max_pooling_keeps_it() -> None:
    rng = np.random.default_rng(0)
    train, y_train = _pooled(40, 8, rng)
    groups_train = np.repeat(np.arange(40), 2)
    aurocs: dict[tuple[str, int], float] = {}
    for k in (1, 4):
        test, y_test = _pooled(40, 8 * k, rng)
        for pooling in ("mean", "max"):
            result = evaluate_d1(train[pooling], y_train, groups_train, test[pooling], y_test,
                                 np.repeat(np.arange(40), 2), n_folds=5, seed=0, n_bootstrap=10)
            aurocs[(pooling, k)] = result["logistic"].test_auroc
    assert aurocs[("mean", 1)] > 0.85 and aurocs[("max", 1)] > 0.9
    assert aurocs[("mean", 4)] < aurocs[("mean", 1)] - 0.08  # diluted: mean pooling loses D1 at 4x length
    assert aurocs[("max", 4)] > 0.9  # the max still finds the token
