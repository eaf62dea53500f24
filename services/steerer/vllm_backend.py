"""vLLM backend (GPU clusters, `--backend vllm`): the same steering as the transformers backend.

How: a forward hook on the vLLM model's decoder layer `layer`, installed in the engine's worker through
`LLM.apply_model` (V1 engine; `collective_rpc` underneath). vLLM decoder layers return (hidden, residual)
and fuse the residual add into the next layer's norm, so the residual stream after the layer is their sum;
adding delta to `hidden` adds it to that sum. delta lives in a device buffer on the layer, rewritten before
each `generate()` (one per alpha; every other layer's buffer is zeroed), so no hook is re-registered
between alphas; `close()` removes the hooks. `enforce_eager=True` because
hooks do not fire under CUDA-graph replay; prefix caching is off so KV blocks computed under another alpha
are never reused. Per-prompt seeds use vLLM's per-request `SamplingParams(seed=...)`: sampled text matches
the transformers backend only in distribution, greedy text token for token (up to kernel round-off).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from .backend import Generation, GenerationSettings, generate_by_delta
from .errors import SteeringError
from .prompts import encode_prompts, resolve_prompt_format

INSTALL_HINT = "the vLLM backend needs vLLM: pip install 'poolbench[vllm]'"


def _decoder_layers(model):
    """The decoder block list of a vLLM model (model.model.layers for Llama/Mistral/Qwen/Gemma)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise RuntimeError(f"vLLM model {type(model).__name__} has no .model.layers")
    return layers


def _install(model, layer: int, hidden_size: int):
    import torch

    block = _decoder_layers(model)[layer]
    if getattr(block, "_poolbench_steer", None) is None:
        param = next(model.parameters())
        block._poolbench_steer = torch.zeros(hidden_size, device=param.device, dtype=param.dtype)

        def hook(_module, _args, output):
            buf = block._poolbench_steer
            if isinstance(output, tuple):
                return (output[0] + buf, *output[1:])
            return output + buf

        block._poolbench_hook = block.register_forward_hook(hook)
    return True


def _set_delta(model, layer: int, values: list[float]):
    """Zero every installed buffer, then write delta into `layer`'s: only one layer steers at a time."""
    import torch

    for other in _decoder_layers(model):
        if getattr(other, "_poolbench_steer", None) is not None:
            other._poolbench_steer.zero_()
    block = _decoder_layers(model)[layer]
    buf = block._poolbench_steer
    buf.copy_(torch.tensor(values, dtype=buf.dtype, device=buf.device))
    return True


def _remove_all(model):
    for block in _decoder_layers(model):
        handle = getattr(block, "_poolbench_hook", None)
        if handle is not None:
            handle.remove()
            block._poolbench_hook = None
            block._poolbench_steer = None
    return True


class VLLMBackend:
    def __init__(self, model_path: str, *, dtype: str = "auto", gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, seed: int = 0) -> None:
        try:
            import vllm  # pyright: ignore[reportMissingImports]  (the optional GPU extra)
        except ImportError as exc:
            raise SteeringError(INSTALL_HINT) from exc
        # apply_model ships these functions to the engine process; V1 needs this to allow it.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self._vllm = vllm
        self.llm = vllm.LLM(model=model_path, dtype=dtype, enforce_eager=True, enable_prefix_caching=False,
                            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                            seed=seed)
        config = self.llm.llm_engine.model_config.hf_config
        self.hidden_size = int(getattr(config, "hidden_size", 0) or config.get_text_config().hidden_size)
        self.n_layers = int(getattr(config, "num_hidden_layers", 0) or config.get_text_config().num_hidden_layers)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompts: Sequence[str], *, layer: int, delta: np.ndarray | None, seeds: Sequence[int],
                 settings: GenerationSettings, prompt_format: str = "auto") -> list[Generation]:
        prompt_format = resolve_prompt_format(self.tokenizer, prompt_format)
        if not 0 <= layer < self.n_layers:
            raise SteeringError(f"layer {layer} out of range ({self.n_layers} layers)")
        if len(seeds) != len(prompts):
            raise SteeringError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        values = np.zeros(self.hidden_size, np.float32) if delta is None else np.asarray(delta, np.float32)
        self.llm.apply_model(lambda model: _install(model, layer, self.hidden_size))
        self.llm.apply_model(lambda model: _set_delta(model, layer, values.tolist()))
        params = [self._vllm.SamplingParams(
            temperature=0.0 if settings.greedy else settings.temperature, top_p=1.0,
            seed=None if settings.greedy else int(s), max_tokens=settings.max_new_tokens,
            min_tokens=settings.min_tokens, skip_special_tokens=True) for s in seeds]
        # Token ids, not text: vLLM would add the tokenizer's special tokens to a chat-formatted text again.
        ids = encode_prompts(self.tokenizer, prompts, prompt_format)
        outputs = self.llm.generate([{"prompt_token_ids": list(i)} for i in ids], params, use_tqdm=False)
        return [Generation(p, o.outputs[0].text, tuple(o.prompt_token_ids), tuple(o.outputs[0].token_ids))
                for p, o in zip(prompts, outputs, strict=True)]

    def generate_rows(self, prompts: Sequence[str], *, layer: int, deltas: Sequence[np.ndarray | None],
                      seeds: Sequence[int], settings: GenerationSettings, prompt_format: str = "auto",
                      ) -> list[Generation]:
        """One engine call per distinct delta: the hook's buffer holds a single delta for the whole engine."""
        return generate_by_delta(self, prompts, layer=layer, deltas=deltas, seeds=seeds, settings=settings,
                                 prompt_format=prompt_format)

    def close(self) -> None:
        """Remove the steering hooks from the engine's model."""
        self.llm.apply_model(_remove_all)
