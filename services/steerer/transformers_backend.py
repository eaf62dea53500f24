"""transformers backend: a forward hook adds delta at every position of one decoder layer's output.

One `generate` call per batch of prompts at one alpha, left padding, per-prompt seeds (see sampling.py).
Prompts go in as `prompt_format` says (prompts.py: a chat template's user turn for instruct models).
The hook is installed with `add_hooks` and removed when the call returns, also on error. Nothing shared is
mutated (the hook is request-local, left padding is asked per call), so a steered call never touches another.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import LogitsProcessorList

from poolbench.extractor.hook_points import add_hooks
from poolbench.extractor.loading import LoadedModel

from .backend import Generation, GenerationSettings
from .errors import SteeringError
from .prompts import format_prompt, resolve_prompt_format
from .sampling import RowSeededSampler


class TransformersBackend:
    def __init__(self, loaded: LoadedModel) -> None:
        if loaded.kind != "causal":
            raise SteeringError(f"model '{loaded.model_id}' is an encoder; steering needs a causal LM")
        self.loaded = loaded

    def generate(self, prompts: Sequence[str], *, layer: int, delta: np.ndarray | None,
                 seeds: Sequence[int], settings: GenerationSettings, prompt_format: str = "auto",
                 ) -> list[Generation]:
        prompt_format = resolve_prompt_format(self.loaded.tokenizer, prompt_format)
        if len(seeds) != len(prompts):
            raise SteeringError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not 0 <= layer < self.loaded.n_layers:
            raise SteeringError(f"layer {layer} out of range for '{self.loaded.model_id}' "
                                f"({self.loaded.n_layers} layers)")
        out: list[Generation] = []
        for start in range(0, len(prompts), settings.batch_size):
            stop = start + settings.batch_size
            out.extend(self._generate_batch(list(prompts[start:stop]), layer, delta, list(seeds[start:stop]),
                                            settings, prompt_format))
        return out

    @torch.no_grad()
    def _generate_batch(self, prompts: list[str], layer: int, delta: np.ndarray | None, seeds: list[int],
                        settings: GenerationSettings, prompt_format: str) -> list[Generation]:
        m = self.loaded
        tok = m.tokenizer
        # A chat template writes its own special tokens; plain prompts get the tokenizer's usual ones.
        enc = tok([format_prompt(tok, p, prompt_format) for p in prompts], return_tensors="pt", padding=True,
                  padding_side="left", add_special_tokens=prompt_format == "plain").to(m.device)
        processors = LogitsProcessorList()
        if not settings.greedy:
            processors.append(RowSeededSampler(seeds, settings.temperature))
        hooks = {}
        if delta is not None:
            vec = torch.as_tensor(np.asarray(delta), dtype=m.dtype, device=m.device)
            hooks[f"layers.{layer}.out"] = lambda hidden: hidden + vec
        with add_hooks(m.decoder_layers, hooks):
            generated = m.model.generate(
                **enc, max_new_tokens=settings.max_new_tokens,
                min_new_tokens=settings.min_tokens, do_sample=False, num_beams=1,
                logits_processor=processors, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                temperature=None, top_p=None, top_k=None)
        width = enc["input_ids"].shape[1]
        results = []
        for row, prompt in enumerate(prompts):
            mask = enc["attention_mask"][row].bool()
            prompt_ids = tuple(enc["input_ids"][row][mask].tolist())
            new = generated[row, width:].tolist()
            if tok.eos_token_id is not None and tok.eos_token_id in new:
                new = new[:new.index(tok.eos_token_id)]
            results.append(Generation(prompt, tok.decode(new, skip_special_tokens=True), prompt_ids, tuple(new)))
        return results
