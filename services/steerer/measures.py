"""Model-side measurements D2 needs: the residual-stream scale, perplexity of generations (given their prompt, or
alone under the fluency guard's reference model), relevance."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import numpy as np
import torch

from poolbench.extractor.hook_points import capture_layer_outputs
from poolbench.extractor.loading import LoadedModel
from poolbench.extractor.logsumexp_rows import logsumexp_rows

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

    Rows are left-padded, so every continuation ends at the last position, and the LM head runs only on the K
    positions that predict a continuation token (K the longest continuation of the chunk; `logits_to_keep` as
    those positions): it never runs over prompts. Chunks hold at most `token_budget` tokens (rows x width) and
    are cut from the rows in order of length, so a chunk pads little (the reference pass over a run's ~900
    continuations padded 15% in the order they came, 2% sorted); each row's values return to its place.
    """
    nll = np.zeros(len(generations))
    n_tok = np.zeros(len(generations), dtype=np.int64)
    pad = loaded.tokenizer.pad_token_id
    pad = 0 if pad is None else pad
    keep_only_scored = _accepts_logits_to_keep(loaded.model)
    lengths = [len(g.prompt_ids) + len(g.token_ids) for g in generations]
    order = sorted(range(len(generations)), key=lambda i: (lengths[i], len(generations[i].token_ids)))
    start = 0
    while start < len(order):
        stop, widest = start, 0
        while stop < len(order) and (stop == start or
                                     (stop + 1 - start) * max(widest, lengths[order[stop]]) <= token_budget):
            widest = max(widest, lengths[order[stop]])
            stop += 1
        rows = order[start:stop]
        start = stop
        chunk = [generations[i] for i in rows]
        k = max(len(g.token_ids) for g in chunk)
        if k == 0:
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
        scored = torch.arange(widest - k - 1, widest - 1)  # the positions whose next token is a continuation token
        extra = {"logits_to_keep": scored.to(loaded.device)} if keep_only_scored else {}
        logits = loaded.model(input_ids=ids.to(loaded.device), attention_mask=mask.to(loaded.device),
                              position_ids=positions.to(loaded.device), **extra).logits
        if not keep_only_scored:
            logits = logits[:, scored]
        logits = logits.float().cpu().reshape(-1, logits.shape[-1])  # [rows * K, V], vocabulary rows contiguous
        # -log p(t) = logsumexp(logits) - logits[t], on every kept row (a padding row's value is dropped): 2e-6
        # nats from float64 on random Gemma-width logits where cross_entropy's log-softmax gives 5e-5 (0.14 s more
        # per 1,000 rows); a transposed [N, V, K] view took 3.6x as long and summed less exactly still.
        # logsumexp_rows: torch.logsumexp's bits without its [N, V] temporary (0.3 s of every 1,024-token chunk).
        flat = target.reshape(-1)
        picked = logits.gather(1, flat.clamp_min(0).unsqueeze(1)).squeeze(1)
        losses = torch.where(flat != -100, logsumexp_rows(logits) - picked, 0.0).reshape(target.shape)
        nll[rows] = losses.sum(dim=1).double().numpy()
        n_tok[rows] = (target != -100).sum(dim=1).numpy()
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
