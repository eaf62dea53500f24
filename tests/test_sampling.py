"""Device-side seeded sampling: Gumbel-max draws fit softmax(logits / T) (chi-square, and a biased sampler fails
the same test), steps and seeds give independent draws, and a row's noise ignores the rest of its batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from poolbench.steerer.sampling import (
    _MIX32,
    UNIFORM_BITS,
    RowSeededSampler,
    fmix32,
    gumbel_noise,
    row_keys,
    token_keys,
    uniform_noise,
)

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.5])
T = 0.7
ROWS, STEPS = 4000, 5


def _draws(sampler_scores) -> np.ndarray:
    """[STEPS, ROWS] token ids: ROWS seeded rows with the same logits, STEPS calls of the processor."""
    scores = LOGITS.repeat(ROWS, 1)
    return np.stack([sampler_scores(scores).argmax(-1).numpy() for _ in range(STEPS)])


def _p_value(draws: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(draws.ravel(), minlength=len(probs))
    probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
    return float(chisquare(counts, probs * counts.sum()).pvalue)


def test_draws_fit_softmax_at_temperature():
    sampler = RowSeededSampler(range(ROWS), temperature=T)
    draws = _draws(lambda s: sampler(None, s))
    expected = torch.softmax(LOGITS / T, 0).numpy()
    assert _p_value(draws, expected) > 1e-3
    # The wrong temperature is the same sampler with a bias the test must catch.
    assert _p_value(draws, torch.softmax(LOGITS, 0).numpy()) < 1e-6


def test_a_biased_sampler_fails_the_same_test():
    """Uniform instead of Gumbel noise on the same hashed stream: a plausible bug, far from softmax."""
    tokens = token_keys(len(LOGITS), "cpu")
    seeds = torch.arange(ROWS)
    steps = iter(range(STEPS))
    draws = _draws(lambda s: s / T + uniform_noise(seeds, next(steps), tokens))
    assert _p_value(draws, torch.softmax(LOGITS / T, 0).numpy()) < 1e-6


def test_steps_and_neighbouring_seeds_draw_independently():
    sampler = RowSeededSampler(range(ROWS), temperature=T)
    draws = _draws(lambda s: sampler(None, s))

    def independence_p(a: np.ndarray, b: np.ndarray) -> float:
        table = np.zeros((len(LOGITS), len(LOGITS)))
        np.add.at(table, (a, b), 1)
        table = table[table.sum(1) > 0][:, table.sum(0) > 0]
        return float(chi2_contingency(table).pvalue)

    assert independence_p(draws[0], draws[1]) > 1e-3  # one row, consecutive steps
    assert independence_p(draws[0, 0::2], draws[0, 1::2]) > 1e-3  # seeds 2i and 2i + 1, one step
    # The contingency test does see dependence: a row against itself one step on is far from independent.
    assert independence_p(draws[0], draws[0]) < 1e-6


def test_a_rows_noise_ignores_its_batch_and_follows_seed_and_step():
    tokens = token_keys(50, "cpu")
    alone = gumbel_noise(torch.tensor([77]), 3, tokens)
    batch = gumbel_noise(torch.tensor([5, 77, 123456789012, 77]), 3, tokens)
    assert torch.equal(batch[1], alone[0]) and torch.equal(batch[3], alone[0])
    assert not torch.equal(batch[0], alone[0])
    assert not torch.equal(gumbel_noise(torch.tensor([77]), 4, tokens), alone)
    assert alone.dtype == torch.float32 and torch.isfinite(alone).all()


def test_uniforms_stay_inside_the_open_interval_and_are_flat():
    u = uniform_noise(torch.arange(200), 0, token_keys(5000, "cpu")).numpy().ravel()
    assert u.min() > 0 and u.max() < 1
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    assert chisquare(counts).pvalue > 1e-3


def test_rows_and_seeds_must_match():
    with pytest.raises(ValueError, match="3 rows for 2 seeds"):
        RowSeededSampler([1, 2], temperature=1.0)(None, torch.zeros(3, 4))


def test_in_place_noise_is_the_out_of_place_hash_bit_for_bit():
    """The hash's finaliser and the noise work in place for speed; they must give exactly the numbers of the hash
    written out of place here (MurmurHash3's fmix32, the logical shift, the scaling, -log(-log1p(-u))), so stored
    generations hold, and leave their inputs as they were."""
    def shift(x, k):
        return (x >> k) & ((1 << (32 - k)) - 1)

    seeds = torch.tensor([0, 5, 77, 123456789012, -3])
    tokens = token_keys(4099, "cpu")
    before = tokens.clone()
    m1, m2 = _MIX32
    for step in (0, 1, 17):
        x = tokens[None, :] ^ row_keys(seeds, step)[:, None]
        x = x ^ shift(x, 16)
        x = x * m1
        x = x ^ shift(x, 13)
        x = x * m2
        x = x ^ shift(x, 16)
        u = (shift(x, 32 - UNIFORM_BITS).to(torch.float32) + 0.5) * (2.0 ** -UNIFORM_BITS)
        assert torch.equal(uniform_noise(seeds, step, tokens), u)
        assert torch.equal(gumbel_noise(seeds, step, tokens), -torch.log(-torch.log1p(-u)))
    fmix32(tokens)
    assert torch.equal(tokens, before)
