"""SAE: hand-computed encode, safetensors/npz/SAELens round trips, shape errors, deterministic training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from poolbench.cebench.sae import SAE, SAEError, load_sae, save_sae, train_sae


def _sae(d: int = 3, m: int = 4, seed: int = 0) -> SAE:
    rng = np.random.default_rng(seed)
    return SAE(W_enc=rng.normal(size=(d, m)).astype(np.float32), b_enc=rng.normal(size=m).astype(np.float32),
               W_dec=rng.normal(size=(m, d)).astype(np.float32), b_dec=rng.normal(size=d).astype(np.float32))


def test_encode_by_hand():
    sae = SAE(W_enc=np.array([[1.0, -1.0], [0.0, 2.0]], dtype=np.float32),
              b_enc=np.array([0.5, -1.0], dtype=np.float32),
              W_dec=np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32),
              b_dec=np.array([1.0, 1.0], dtype=np.float32))
    # x - b_dec = [2, 1]; @ W_enc = [2, 0]; + b_enc = [2.5, -1]; ReLU -> [2.5, 0]
    np.testing.assert_allclose(sae.encode(np.array([3.0, 2.0])), [2.5, 0.0])
    np.testing.assert_allclose(sae.decode(np.array([2.5, 0.0])), [3.5, 1.0])


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_round_trip(tmp_path: Path, suffix: str):
    sae = _sae()
    path = save_sae(sae, tmp_path / f"sae{suffix}")
    loaded = load_sae(path, hidden_size=3)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(sae, name))
    assert (loaded.d, loaded.m) == (3, 4)
    assert not list(tmp_path.glob(".*"))  # no temp file left behind


def test_saelens_folder(tmp_path: Path):
    folder = tmp_path / "saelens"
    save_sae(_sae(), folder / "sae_weights.safetensors")
    assert load_sae(folder, hidden_size=3).m == 4
    with pytest.raises(SAEError, match=r"has no sae_weights\.safetensors"):
        load_sae(tmp_path)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_shape_mismatch_names_file_and_tensor(tmp_path: Path, suffix: str):
    path = save_sae(_sae(d=3), tmp_path / f"sae{suffix}")
    with pytest.raises(SAEError, match=rf"sae\{suffix}: tensor W_enc has shape \(3, 4\), expected \(5, 4\) "
                                       r"\(the model's hidden size is 5\)") as info:
        load_sae(path, hidden_size=5)
    assert "\n" not in str(info.value)


def test_inconsistent_and_missing_tensors(tmp_path: Path):
    sae = _sae()
    np.savez(tmp_path / "bad.npz", W_enc=sae.W_enc, b_enc=sae.b_enc, W_dec=sae.W_dec, b_dec=np.zeros(7))
    with pytest.raises(SAEError, match=r"bad\.npz: tensor b_dec has shape \(7,\), expected \(3,\)"):
        load_sae(tmp_path / "bad.npz")
    np.savez(tmp_path / "part.npz", W_enc=sae.W_enc)
    with pytest.raises(SAEError, match=r"part\.npz: tensor b_enc missing"):
        load_sae(tmp_path / "part.npz")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SAEError, match=r"junk\.safetensors: unreadable SAE weights"):
        load_sae(tmp_path / "junk.safetensors")


def test_train_sae_is_deterministic_and_learns_a_sparse_dictionary():
    rng = np.random.default_rng(0)
    atoms = rng.normal(size=(8, 16)) * 5
    codes = (rng.random((2000, 8)) < 0.15) * rng.random((2000, 8)) * 3
    x = (codes @ atoms + 2.0).astype(np.float32)
    sae, report = train_sae(x, 32, l1=3e-3, steps=400, seed=1, lr=3e-3, batch_size=256)
    again, _ = train_sae(x, 32, l1=3e-3, steps=400, seed=1, lr=3e-3, batch_size=256)
    np.testing.assert_array_equal(sae.W_enc, again.W_enc)
    assert report.fraction_variance_unexplained < 0.1
    assert report.mean_l0 < 16
    recon = sae.decode(sae.encode(x))  # the scale folded into the weights: raw activations in and out
    assert np.mean((recon - x) ** 2) == pytest.approx(report.final_mse, rel=1e-3)
