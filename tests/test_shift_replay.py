"""shift_replay: the exact shift of many deltas replayed from the layer equals the full forward's, per delta and
passage (passages of different lengths, so padding is in the batch); the model's blocks are its own afterwards."""

from __future__ import annotations

import numpy as np
import pytest
from tolerances import assert_float32_close

from poolbench.extractor.loading import LoadedModel, load_model
from poolbench.steerer.errors import SteeringError
from poolbench.steerer.likelihood_shift import passage_log_likelihoods
from poolbench.steerer.shift_replay import replayed_shifts

pytestmark = pytest.mark.numerics
TEXTS = ["the cat sat on the mat.", "a river ran near the old mill and the cat slept",
         "it might rain, I suppose.", "no."]


@pytest.fixture(scope="module")
def loaded(layered_llama_dir) -> LoadedModel:
    return load_model(str(layered_llama_dir), device="cpu")


def _tolerance_terms(loaded: LoadedModel, n_tokens: int) -> int:
    """A row's log p: blocks of width d and MLP 2d over its tokens, the head's d-term dot products, a log-softmax
    over the vocabulary, then the sum over its tokens."""
    d = loaded.hidden_size
    return loaded.n_layers * (d + 2 * d + n_tokens) + d + len(loaded.tokenizer) + n_tokens


@pytest.mark.parametrize("layer", [0, 1])  # below the last block and the last itself
def test_replayed_shift_equals_the_full_forwards(loaded, layer) -> None:
    rng = np.random.default_rng(layer)
    deltas = rng.standard_normal((5, loaded.hidden_size)) * np.array([[0.0], [0.3], [-0.3], [1.0], [2.0]])
    # max_tokens small enough that the five deltas replay in several chunks of the batch of four
    base, steered = replayed_shifts(loaded, TEXTS, layer, deltas, batch_size=4, max_length=64, max_tokens=80)
    full_base = passage_log_likelihoods(loaded, TEXTS, max_length=64)
    n_tokens = max(len(loaded.tokenizer(t)["input_ids"]) for t in TEXTS)
    terms = _tolerance_terms(loaded, n_tokens)
    scale = float(np.abs(full_base).max())
    assert_float32_close(base, full_base, terms=terms, scale=scale, err_msg="unsteered")
    for k, delta in enumerate(deltas):
        full = passage_log_likelihoods(loaded, TEXTS, layer=layer, delta=delta, max_length=64)
        assert_float32_close(steered[k], full, terms=terms, scale=max(scale, float(np.abs(full).max())),
                             err_msg=f"delta {k} at layer {layer}")
    assert_float32_close(steered[0], base, terms=terms, scale=scale, err_msg="zero delta")  # the stored state
    # should fail: the replay's shift is the delta's own, not another row's or layer's
    assert np.abs(steered[4] - steered[3]).max() > 100 * np.abs(steered[0] - base).max() + 1e-6
    assert all(type(b).__name__ != "_Handoff" for b in loaded.decoder_layers)


def test_a_delta_at_another_layer_gives_another_shift(loaded) -> None:
    delta = np.random.default_rng(7).standard_normal((1, loaded.hidden_size))
    _, at0 = replayed_shifts(loaded, TEXTS, 0, delta, max_length=64)
    _, at1 = replayed_shifts(loaded, TEXTS, 1, delta, max_length=64)
    full1 = passage_log_likelihoods(loaded, TEXTS, layer=1, delta=delta[0], max_length=64)
    assert np.abs(at0[0] - full1).max() > 0.1 and np.abs(at1[0] - full1).max() < 0.1


def test_bad_deltas_and_layers_name_themselves(loaded) -> None:
    with pytest.raises(SteeringError, match=r"deltas of shape \(3,\)"):
        replayed_shifts(loaded, TEXTS, 0, np.zeros(3))
    with pytest.raises(SteeringError, match="layer 9"):
        replayed_shifts(loaded, TEXTS, 9, np.zeros((1, loaded.hidden_size)))
