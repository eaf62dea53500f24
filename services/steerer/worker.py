"""SteeringWorker: one loaded causal LM with its generation backend and the measurements D2 needs.

A plain class so tests and the pipeline can use it in-process; `steering_actor` wraps it as a Ray actor
(one GPU each when the cluster has GPUs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from poolbench.errors import PoolBenchError
from poolbench.extractor.loading import LoadedModel, load_model

from .backend import Generation, GenerationSettings, SteeringBackend
from .errors import SteeringError
from .fluency import AUTO, SELF, reference_model_for
from .measures import SentenceEmbedder, continuation_nll, mean_residual_norms, reference_nll
from .prompts import resolve_prompt_format

BACKENDS = ("transformers", "vllm")


class SteeringWorker:
    def __init__(self, model: str | LoadedModel, *, backend: str = "transformers", dtype: str = "auto",
                 device: str = "auto", model_args: dict | None = None, torch_threads: int | None = None,
                 vllm_args: dict | None = None) -> None:
        if backend not in BACKENDS:
            raise SteeringError(f"unknown steering backend '{backend}' (known: {', '.join(BACKENDS)})")
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.loaded = model if isinstance(model, LoadedModel) else load_model(
            model, dtype=dtype, device=device, model_args=model_args)
        self.backend_name = backend
        self.backend: SteeringBackend
        if backend == "vllm":
            from .vllm_backend import VLLMBackend

            self.backend = VLLMBackend(str(self.loaded.path), **(vllm_args or {}))
        else:
            from .transformers_backend import TransformersBackend

            self.backend = TransformersBackend(self.loaded)
        self._embedder: SentenceEmbedder | None = None
        self._references: dict[str, LoadedModel] = {}

    def info(self) -> dict:
        m = self.loaded
        return {"model_id": m.model_id, "weights_hash": m.weights_hash, "n_layers": m.n_layers,
                "hidden_size": m.hidden_size, "dtype": str(m.dtype), "device": str(m.device),
                "backend": self.backend_name}

    def prompt_format(self, option: str = "auto") -> str:
        """'chat' for a tokenizer with a chat template (an instruct model), else 'plain'; `option` overrides."""
        return resolve_prompt_format(self.loaded.tokenizer, option)

    def generate(self, prompts: Sequence[str], *, layer: int, delta: np.ndarray | None, seeds: Sequence[int],
                 settings: GenerationSettings, prompt_format: str = "auto") -> list[Generation]:
        return self.backend.generate(prompts, layer=layer, delta=delta, seeds=seeds, settings=settings,
                                     prompt_format=prompt_format)

    def generate_rows(self, prompts: Sequence[str], *, layer: int | Sequence[int],
                      deltas: Sequence[np.ndarray | None], seeds: Sequence[int], settings: GenerationSettings,
                      prompt_format: str = "auto") -> list[Generation]:
        """One delta per prompt (None: unsteered) and one layer or one per prompt, so whole alpha grids x
        prompts of several cells share batches."""
        return self.backend.generate_rows(prompts, layer=layer, deltas=deltas, seeds=seeds, settings=settings,
                                          prompt_format=prompt_format)

    def residual_norm(self, texts: Sequence[str], layer: int) -> float:
        return self.residual_norms(texts, [layer])[int(layer)]

    def residual_norms(self, texts: Sequence[str], layers: Sequence[int]) -> dict[int, float]:
        """alpha's unit at each of `layers` from one forward per batch (measures.mean_residual_norms)."""
        return mean_residual_norms(self.loaded, texts, layers)

    def nll(self, generations: Sequence[Generation]) -> tuple[np.ndarray, np.ndarray]:
        return continuation_nll(self.loaded, generations)

    def reference_name(self, option: str = AUTO) -> str:
        """The fluency guard's reference model for this worker's model (fluency.reference_model_for)."""
        return reference_model_for(self.loaded.model_id, option)

    def reference_nll(self, texts: Sequence[str], option: str = AUTO) -> tuple[np.ndarray, np.ndarray]:
        """Each text's NLL alone under the reference model, loaded once on this worker's device (float32)."""
        return reference_nll(self.reference_model(option), texts)

    def reference_model(self, option: str = AUTO) -> LoadedModel:
        """The fluency guard's reference model (this worker's own for "self"), loaded on the first call. Called
        ahead by a CPU run's early engines (early_engines.py): the load, ~5 s of one core and a 1 GB read that the
        page cache may not hold, then runs beside D1's last probes, not between generation and the guard."""
        name = self.reference_name(option)
        if name == SELF:
            return self.loaded
        if name not in self._references:
            self._references[name] = load_model(name, dtype="float32", device=str(self.loaded.device))
        return self._references[name]

    def prepare_reference(self, option: str = AUTO) -> str | None:
        """Load the reference model now (reference_model): None, or the one line saying why it could not. Called
        with no one waiting for it, so a model that fails to load is reported where the run reports steering
        errors, by the guard's own call, which loads it again and raises."""
        try:
            self.reference_model(option)
        except PoolBenchError as exc:
            return str(exc)
        return None

    def relevance(self, prompts: Sequence[str], continuations: Sequence[str]) -> np.ndarray:
        if self._embedder is None:
            self._embedder = SentenceEmbedder()
        return self._embedder.relevance(prompts, continuations)
