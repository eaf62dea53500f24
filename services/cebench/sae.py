"""Sparse autoencoders: SAELens-style weights (load/save safetensors or npz), encode, and a small CPU trainer.

Weights: W_enc [d, m], b_enc [m], W_dec [m, d], b_dec [d]; features f = ReLU((x - b_dec) W_enc + b_enc),
reconstruction x_hat = f W_dec + b_dec. A SAELens folder (sae_weights.safetensors + cfg.json) loads by folder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from poolbench.determinism import deterministic_cpu
from poolbench.errors import PoolBenchError

TENSOR_NAMES = ("W_enc", "b_enc", "W_dec", "b_dec")
SAELENS_WEIGHTS_FILE = "sae_weights.safetensors"


class SAEError(PoolBenchError):
    """SAE weights that are missing, malformed or do not fit the model."""


@dataclass
class SAE:
    """Weights as float32 numpy arrays; `d` is the model's hidden size, `m` the number of features."""

    W_enc: np.ndarray
    b_enc: np.ndarray
    W_dec: np.ndarray
    b_dec: np.ndarray

    @property
    def d(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def m(self) -> int:
        return int(self.W_enc.shape[1])

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Feature activations [..., m] of activations [..., d]."""
        return np.maximum((np.asarray(x, dtype=np.float32) - self.b_dec) @ self.W_enc + self.b_enc, 0)

    def decode(self, f: np.ndarray) -> np.ndarray:
        return np.asarray(f, dtype=np.float32) @ self.W_dec + self.b_dec

    def tensors(self) -> dict[str, np.ndarray]:
        return {name: np.ascontiguousarray(getattr(self, name), dtype=np.float32) for name in TENSOR_NAMES}


def check_shapes(tensors: dict[str, np.ndarray], hidden_size: int | None, where: str) -> None:
    """One-line SAEError naming `where` and the first tensor whose shape does not fit."""
    for name in TENSOR_NAMES:
        if name not in tensors:
            raise SAEError(f"{where}: tensor {name} missing (has {', '.join(sorted(tensors)) or 'none'})")
    w_enc = tensors["W_enc"]
    if w_enc.ndim != 2:
        raise SAEError(f"{where}: tensor W_enc has shape {tuple(w_enc.shape)}, expected 2-d [d, m]")
    d = w_enc.shape[0] if hidden_size is None else hidden_size
    m = w_enc.shape[1]
    expected = {"W_enc": (d, m), "b_enc": (m,), "W_dec": (m, d), "b_dec": (d,)}
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            why = f" (the model's hidden size is {hidden_size})" if hidden_size is not None else ""
            raise SAEError(f"{where}: tensor {name} has shape {tuple(tensors[name].shape)}, expected "
                           f"{shape}{why}")


def _resolve(path: Path) -> Path:
    if path.is_dir():
        candidate = path / SAELENS_WEIGHTS_FILE
        if not candidate.is_file():
            raise SAEError(f"{path}: folder has no {SAELENS_WEIGHTS_FILE}")
        return candidate
    if not path.is_file():
        raise SAEError(f"{path}: no such SAE weights file")
    return path


def load_sae(path: str | Path, hidden_size: int | None = None) -> SAE:
    """SAE weights from .safetensors, .npz or a SAELens folder, checked against `hidden_size` when given."""
    path = _resolve(Path(path))
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                tensors = {k: np.asarray(data[k]) for k in data.files}
        elif path.suffix == ".safetensors":
            from safetensors.numpy import load_file

            tensors = load_file(str(path))
        else:
            raise SAEError(f"{path}: SAE weights must be .safetensors, .npz or a SAELens folder")
    except (OSError, ValueError) as exc:
        raise SAEError(f"{path}: unreadable SAE weights ({str(exc).splitlines()[0]})") from None
    except Exception as exc:  # safetensors raises its own SafetensorError on corrupt headers
        if isinstance(exc, SAEError):
            raise
        raise SAEError(f"{path}: unreadable SAE weights ({type(exc).__name__}: {exc})") from None
    check_shapes(tensors, hidden_size, str(path))
    return SAE(**{name: np.asarray(tensors[name], dtype=np.float32) for name in TENSOR_NAMES})


def save_sae(sae: SAE, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write .safetensors (with string metadata) or .npz by suffix, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.numpy import save_file

            save_file(sae.tensors(), str(tmp), metadata=metadata)
        elif path.suffix == ".npz":
            np.savez(tmp, **sae.tensors())
        else:
            raise SAEError(f"{path}: SAE output must end in .safetensors or .npz")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@dataclass
class SAETrainReport:
    steps: int
    final_mse: float  # mean squared reconstruction error per element, in the activations' own units
    fraction_variance_unexplained: float
    mean_l0: float  # mean number of active features per token
    dead_features: int  # features never active on the training activations
    scale: float  # the activations were divided by this during training; folded back into the weights


def train_sae(activations: np.ndarray, n_features: int, *, l1: float = 1.0, steps: int = 1500,
              seed: int = 0, lr: float = 1e-3, batch_size: int = 512,
              threads: int = 1) -> tuple[SAE, SAETrainReport]:
    """Deterministic CPU SAE training: Adam on MSE + l1 * sum|f| * ||W_dec row||, on activations rescaled
    so the mean squared norm is d (so one l1 suits any model); the scale is folded back into the weights."""
    x_np = np.asarray(activations, dtype=np.float32)
    if x_np.ndim != 2 or len(x_np) < 2:
        raise SAEError(f"train_sae: activations must be [n >= 2, d], got shape {x_np.shape}")
    n, d = x_np.shape
    scale = float(math.sqrt((x_np.astype(np.float64) ** 2).sum(axis=1).mean() / d)) or 1.0
    with deterministic_cpu(seed, threads):
        x = torch.from_numpy(x_np / scale)
        w_dec = torch.randn(n_features, d)
        w_dec /= w_dec.norm(dim=1, keepdim=True)
        params = {"W_enc": w_dec.T.clone().requires_grad_(),
                  "b_enc": torch.zeros(n_features, requires_grad=True),
                  "W_dec": w_dec.clone().requires_grad_(), "b_dec": x.mean(0).clone().requires_grad_()}
        optimizer = torch.optim.Adam(params.values(), lr=lr)
        generator = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            batch = x[torch.randint(0, n, (min(batch_size, n),), generator=generator)]
            f = torch.relu((batch - params["b_dec"]) @ params["W_enc"] + params["b_enc"])
            recon = f @ params["W_dec"] + params["b_dec"]
            mse = ((recon - batch) ** 2).sum(dim=1).mean()
            sparsity = (f * params["W_dec"].norm(dim=1)).sum(dim=1).mean()
            loss = mse + l1 * sparsity
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            f = torch.relu((x - params["b_dec"]) @ params["W_enc"] + params["b_enc"])
            recon = f @ params["W_dec"] + params["b_dec"]
            err = ((recon - x) ** 2).mean()
            fvu = float(((recon - x) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())
            l0 = float((f > 0).sum(dim=1).float().mean())
            dead = int(((f > 0).sum(dim=0) == 0).sum())
            weights = {k: v.detach().numpy().astype(np.float32) for k, v in params.items()}
    sae = SAE(W_enc=weights["W_enc"] / scale, b_enc=weights["b_enc"], W_dec=weights["W_dec"] * scale,
              b_dec=weights["b_dec"] * scale)
    report = SAETrainReport(steps=steps, final_mse=float(err) * scale**2, fraction_variance_unexplained=fvu,
                            mean_l0=l0, dead_features=dead, scale=scale)
    return sae, report
