"""Model-side measurements D2 needs: the residual-stream scale, perplexity of generations (given their prompt, or
alone under the fluency guard's reference model), relevance."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import numpy as np
import torch

from poolbench.extractor.hook_points import capture_layer_outputs
from poolbench.extractor.loading import LoadedModel

from .backend import Generation


@torch.no_grad()
def mean_residual_norms(loaded: LoadedModel, texts: Sequence[str], layers: Sequence[int], *, batch_size: int = 32,
                        max_length: int = 256) -> dict[int, float]:
    """{L: mean of ||h_t|| at layers.{L}.out} over real tokens, leaving out special tokens and each text's first
    token: the attention sink (a BOS, or the first word where the tokenizer adds none) is an outlier, 22,664 vs a
    median of 154 at SmolLM2's layer 16, and would set alpha's unit by one position. Every layer comes from one
    forward per batch that stops after the deepest (no later block, no LM head): a run's cells of one concept
    share their train passages, and each layer's value is the one a forward for that layer alone gives."""
    tok = loaded.tokenizer
    wanted = sorted({int(layer) for layer in layers})
    if not wanted:
        return {}
    totals, count = dict.fromkeys(wanted, 0.0), 0
    for start in range(0, len(texts), batch_size):
        enc = tok(list(texts[start:start + batch_size]), return_tensors="pt", padding=True, truncation=True,
                  max_length=max_length, return_special_tokens_mask=True)
        special = enc.pop("special_tokens_mask").bool()
        enc = enc.to(loaded.device)
        with capture_layer_outputs(loaded.decoder_layers, wanted) as captured:
            loaded.model(**enc)
        mask = enc["attention_mask"].bool().cpu()
        real = mask & ~special
        real[torch.arange(len(mask)), mask.int().argmax(dim=1)] = False
        for layer in wanted:
            totals[layer] += float(captured[layer].float().norm(dim=-1).cpu()[real].sum())
        count += int(real.sum())
    if count == 0:
        raise ValueError("no real tokens to measure the residual norm on")
    return {layer: total / count for layer, total in totals.items()}


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@torch.no_grad()
def continuation_nll(loaded: LoadedModel, generations: Sequence[Generation], *, token_budget: int = 4096,
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(summed NLL, token count) of each continuation given its prompt, under the unsteered model.

    Rows are left-padded, so every continuation ends at the last position and only the last K + 1 positions'
    logits are computed (K the longest continuation): the LM head and log-softmax never run over prompts.
    Chunks hold at most `token_budget` tokens (rows x width), so a cell's whole alpha grid goes in a few calls.
    """
    nll = np.zeros(len(generations))
    n_tok = np.zeros(len(generations), dtype=np.int64)
    pad = loaded.tokenizer.pad_token_id
    pad = 0 if pad is None else pad
    keep_only_last = _accepts_logits_to_keep(loaded.model)
    lengths = [len(g.prompt_ids) + len(g.token_ids) for g in generations]
    start = 0
    while start < len(generations):
        stop, widest = start, 0
        while stop < len(generations) and (stop == start or
                                           (stop + 1 - start) * max(widest, lengths[stop]) <= token_budget):
            widest = max(widest, lengths[stop])
            stop += 1
        chunk = generations[start:stop]
        k = max(len(g.token_ids) for g in chunk)
        if k == 0:
            start = stop
            continue
        ids = torch.full((len(chunk), widest), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), widest), dtype=torch.long)
        target = torch.full((len(chunk), k), -100, dtype=torch.long)
        for i, g in enumerate(chunk):
            seq = list(g.prompt_ids) + list(g.token_ids)
            ids[i, widest - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[i, widest - len(seq):] = 1
            if g.token_ids:
                target[i, k - len(g.token_ids):] = torch.tensor(g.token_ids, dtype=torch.long)
        positions = (mask.cumsum(dim=1) - 1).clamp_min(0)
        extra = {"logits_to_keep": k + 1} if keep_only_last else {}
        logits = loaded.model(input_ids=ids.to(loaded.device), attention_mask=mask.to(loaded.device),
                              position_ids=positions.to(loaded.device), **extra).logits
        logits = logits[:, -(k + 1):-1].float().cpu()
        # Rows of the vocabulary contiguous: cross_entropy over a transposed [N, V, k] view took 3.6x as long on
        # Gemma's 262k vocabulary and summed less exactly (1e-4 vs 1e-5 nats from float64 on random logits).
        picked = -torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                    ignore_index=-100, reduction="none").reshape(target.shape)
        valid = target != -100
        nll[start:stop] = (-(picked * valid)).sum(dim=1).double().numpy()
        n_tok[start:stop] = valid.sum(dim=1).numpy()
        start = stop
    return nll, n_tok


# Logits held at once (1 GB in float32, twice that with the log-softmax): Gemma's 262k-token vocabulary at 1,024
# tokens a chunk. Chunks of 256 took 2.2x as long as the old prompt-conditioned pass over SmolLM2 on 40 texts; of
# ~1,000, the same time.
LOGIT_BUDGET = 2**28


def reference_nll(loaded: LoadedModel, texts: Sequence[str], *, token_budget: int | None = None,
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(summed NLL, token count) of each text alone under `loaded`, the fluency guard's reference model: the text
    is re-tokenised by the reference's tokenizer and read after its BOS (EOS where it has none), no prompt. Every
    position is scored, so chunks hold at most LOGIT_BUDGET / vocabulary tokens unless `token_budget` says."""
    tok = loaded.tokenizer
    if token_budget is None:
        token_budget = max(64, min(4096, LOGIT_BUDGET // max(len(tok), 1)))
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    if start is None:
        raise ValueError(f"reference model '{loaded.model_id}' has neither a BOS nor an EOS token to start a text")
    ids = tok(list(texts), add_special_tokens=False)["input_ids"] if texts else []
    return continuation_nll(loaded, [Generation("", t, (int(start),), tuple(i)) for t, i in zip(texts, ids,
                                                                                              strict=True)],
                            token_budget=token_budget)


class SentenceEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings as sentence-transformers computes them: mean over real tokens,
    then L2 normalisation (max 256 tokens)."""

    def __init__(self, path: str | None = None, max_length: int = 256) -> None:
        from poolbench.scorer.encoder import bundled_minilm_path
        from poolbench.scorer.finetune import load_encoder

        source = path or str(bundled_minilm_path())
        self.tokenizer, self.model = load_encoder(source, source)
        self.model.eval()
        self.max_length = max_length

    @torch.no_grad()
    def embed(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        out = []
        for start in range(0, len(texts), batch_size):
            enc = self.tokenizer(list(texts[start:start + batch_size]), padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt")
            hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
        return np.concatenate(out) if out else np.zeros((0, int(self.model.config.hidden_size)))

    def relevance(self, prompts: Sequence[str], continuations: Sequence[str]) -> np.ndarray:
        """Cosine between each prompt and its continuation."""
        return np.sum(self.embed(prompts) * self.embed(continuations), axis=1)
