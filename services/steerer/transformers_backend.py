"""transformers backend: forward hooks add each row's own delta at every position of its decoder layer's output.

One `generate` call per chunk of rows (a row is a prompt with its delta and seed), bounded by
`settings.batch_size` rows and `settings.token_budget` tokens; left padding, per-row seeds (see sampling.py).
What holds, exactly: a row's sampling noise depends on its seed and step only; every row with the same prompt
(a cell's alpha rows of one prompt) goes in the same chunk, so they share padding, batch and kernels and differ
only by their delta, on identical noise (paired draws). Across chunks or calls a row's logits agree only up to
the batched forward's round-off: bit for bit in fp32 on CPU in our tests, not in bf16 on a GPU, where
bench/generate.py measures the identical-row rate. Rows may steer at different layers (one layer per row, as
the vLLM backend takes): slot_table.build_layer_tables gives each steered layer a table whose rows are zero
except that layer's deltas, and that layer's hook adds each row's slot row, so unsteered rows and rows steering
elsewhere add exact zeros, which leaves their hidden states bit for bit. Prompts go in as `prompt_format` says
(prompts.py). The hooks are installed with `add_hooks` and removed when the call returns, also on error; nothing
shared is mutated, so a steered call never touches another.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from poolbench.extractor.hook_points import add_hooks
from poolbench.extractor.loading import LoadedModel

from .backend import Generation, GenerationSettings, row_layers, validate_deltas
from .errors import SteeringError
from .prompts import encode_prompts, resolve_prompt_format
from .sampling import RowSeededSampler, StepCounter
from .slot_table import build_layer_tables


def row_chunks(lengths: Sequence[int], max_new_tokens: int, max_rows: int, token_budget: int) -> list[range]:
    """Consecutive row ranges with at most `max_rows` rows and rows x (longest prompt + new tokens) within
    the budget; a row over the budget on its own still gets a chunk of one."""
    chunks: list[range] = []
    start, widest = 0, 0
    for i, n in enumerate(lengths):
        grown = max(widest, n)
        rows = i - start + 1
        if i > start and (rows > max_rows or rows * (grown + max_new_tokens) > token_budget):
            chunks.append(range(start, i))
            start, grown = i, n
        widest = grown
    if len(lengths) > start:
        chunks.append(range(start, len(lengths)))
    return chunks


def prompt_group_chunks(ids: Sequence[Sequence[int]], max_new_tokens: int, max_rows: int, token_budget: int,
                        ) -> list[list[int]]:
    """Row indices per generate call, rows of one prompt always together, whole groups packed in first-seen
    order within `max_rows` and the token budget; only a group over the limits on its own is split (into
    consecutive pieces of equal width)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, row in enumerate(ids):
        groups.setdefault(tuple(row), []).append(i)
    chunks: list[list[int]] = []
    current: list[int] = []
    width = 0
    for prompt, rows in groups.items():
        n = len(prompt)
        if len(rows) > max_rows or len(rows) * (n + max_new_tokens) > token_budget:
            chunks.extend([rows[r.start:r.stop] for r in row_chunks([n] * len(rows), max_new_tokens, max_rows,
                                                                    token_budget)])
            continue
        grown = max(width, n)
        if current and (len(current) + len(rows) > max_rows
                        or (len(current) + len(rows)) * (grown + max_new_tokens) > token_budget):
            chunks.append(current)
            current, grown = [], n
        current = current + rows
        width = grown
    if current:
        chunks.append(current)
    return chunks


@dataclass
class GenerationProgress:
    """How far one generate_rows call is: rows finished and tokens sampled so far (a display, polled)."""

    rows_total: int
    tokens_total: int
    rows_done: int = 0
    tokens_done: int = 0
    started: float = field(default_factory=time.perf_counter)

    def step(self, rows: int) -> None:
        self.tokens_done += rows

    def snapshot(self) -> dict:
        return {"rows_done": self.rows_done, "rows_total": self.rows_total, "tokens_done": self.tokens_done,
                "tokens_total": self.tokens_total, "seconds": time.perf_counter() - self.started}


class TokenTap(LogitsProcessor):
    """Hands each row's tokens to `on_token(row, token)` as they are drawn (a token shows in `input_ids` at the next
    step; the last one after the call, `finish`); a row's EOS and what follows it are not handed on."""

    def __init__(self, rows: Sequence[int], width: int, on_token: Callable[[int, int], None], eos: int | None):
        self.rows, self.width, self.on_token, self.eos = list(rows), width, on_token, eos
        self.done: set[int] = set()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] > self.width:
            self.emit(input_ids[:, -1].tolist())
        return scores

    def emit(self, tokens: list[int]) -> None:
        for row, token in zip(self.rows, tokens, strict=True):
            if row in self.done:
                continue
            if self.eos is not None and token == self.eos:
                self.done.add(row)
                continue
            self.on_token(row, int(token))

    def finish(self, generated: torch.Tensor) -> None:
        if generated.shape[1] > self.width:
            self.emit(generated[:, -1].tolist())


class TransformersBackend:
    streams_tokens = True  # generate_rows takes on_token (the HTTP app's server-sent events)

    def __init__(self, loaded: LoadedModel) -> None:
        if loaded.kind != "causal":
            raise SteeringError(f"model '{loaded.model_id}' is an encoder; steering needs a causal LM")
        self.loaded = loaded
        self.progress: GenerationProgress | None = None

    def generate(self, prompts: Sequence[str], *, layer: int, delta: np.ndarray | None,
                 seeds: Sequence[int], settings: GenerationSettings, prompt_format: str = "auto",
                 ) -> list[Generation]:
        return self.generate_rows(prompts, layer=layer, deltas=[delta] * len(prompts), seeds=seeds,
                                  settings=settings, prompt_format=prompt_format)

    def generate_rows(self, prompts: Sequence[str], *, layer: int | Sequence[int],
                      deltas: Sequence[np.ndarray | None], seeds: Sequence[int], settings: GenerationSettings,
                      prompt_format: str = "auto", on_token: Callable[[int, int], None] | None = None,
                      ) -> list[Generation]:
        """Every row with its own delta, seed and (where `layer` is a sequence) layer, in shared chunks;
        `on_token(row, token)` sees each row's tokens as they are drawn."""
        m = self.loaded
        prompt_format = resolve_prompt_format(m.tokenizer, prompt_format)
        layers = row_layers(layer, len(prompts))
        if len(seeds) != len(prompts):
            raise SteeringError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if len(deltas) != len(prompts):
            raise SteeringError(f"{len(prompts)} prompts but {len(deltas)} steering deltas")
        if len(layers) != len(prompts):
            raise SteeringError(f"{len(prompts)} prompts but {len(layers)} layers")
        bad = [x for x in layers if not 0 <= x < m.n_layers]
        if bad:
            raise SteeringError(f"layer {bad[0]} out of range for '{m.model_id}' ({m.n_layers} layers)")
        validate_deltas(deltas, m.hidden_size, torch.finfo(m.dtype).max)
        tables, slots = build_layer_tables(layers, deltas, m.hidden_size)
        on_device = {at: torch.as_tensor(t, dtype=m.dtype, device=m.device) for at, t in tables.items()}
        ids = encode_prompts(m.tokenizer, list(prompts), prompt_format)
        out: list[Generation | None] = [None] * len(prompts)
        self.progress = GenerationProgress(rows_total=len(prompts),
                                           tokens_total=len(prompts) * settings.max_new_tokens)
        try:
            for rows in prompt_group_chunks(ids, settings.max_new_tokens, settings.batch_size,
                                            settings.token_budget):
                gens = self._generate_batch([prompts[i] for i in rows], [ids[i] for i in rows], on_device,
                                            [slots[i] for i in rows], [seeds[i] for i in rows], settings,
                                            None if on_token is None else (rows, on_token))
                for i, g in zip(rows, gens, strict=True):
                    out[i] = g
                self.progress.rows_done += len(rows)
                self.progress.tokens_done = self.progress.rows_done * settings.max_new_tokens
        finally:
            self.progress = None
        return [g for g in out if g is not None]

    @torch.no_grad()
    def _generate_batch(self, prompts: list[str], ids: list[list[int]], tables: dict[int, torch.Tensor],
                        slots: list[int], seeds: list[int], settings: GenerationSettings,
                        tap: tuple[list[int], Callable[[int, int], None]] | None = None) -> list[Generation]:
        m = self.loaded
        tok = m.tokenizer
        enc = tok.pad({"input_ids": ids}, return_tensors="pt", padding=True, padding_side="left").to(m.device)
        processors = LogitsProcessorList()
        width = enc["input_ids"].shape[1]
        token_tap = None if tap is None else TokenTap(tap[0], width, tap[1], tok.eos_token_id)
        if token_tap is not None:
            processors.append(token_tap)
        progress = self.progress
        if progress is not None:
            rows_in_batch = len(prompts)
            processors.append(StepCounter(lambda: progress.step(rows_in_batch)))
        if not settings.greedy:
            processors.append(RowSeededSampler(seeds, settings.temperature))
        index = torch.as_tensor(slots, dtype=torch.long, device=m.device)
        # A layer whose table is zero for every row of this chunk gets no hook: adding zeros would change nothing.
        hooks = {f"layers.{at}.out": _add_rows(table[index][:, None, :])
                 for at, table in tables.items() if bool(table[index].any())}
        with add_hooks(m.decoder_layers, hooks):
            generated = m.model.generate(
                **enc, max_new_tokens=settings.max_new_tokens,
                min_new_tokens=settings.min_tokens, do_sample=False, num_beams=1,
                logits_processor=processors, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                temperature=None, top_p=None, top_k=None)
        if token_tap is not None:
            token_tap.finish(generated)
        results = []
        for row, prompt in enumerate(prompts):
            new = generated[row, width:].tolist()
            if tok.eos_token_id is not None and tok.eos_token_id in new:
                new = new[:new.index(tok.eos_token_id)]
            results.append(Generation(prompt, tok.decode(new, skip_special_tokens=True), tuple(ids[row]),
                                      tuple(new)))
        return results


def _add_rows(per_row: torch.Tensor):
    """A hook function adding each row's [1, d] delta at every position of the hidden state [B, T, d]."""
    return lambda hidden: hidden + per_row
