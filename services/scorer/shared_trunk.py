"""Several classifier B scorers over the same texts, their frozen lower blocks run once.

Every scorer is fine-tuned from the same MiniLM with only its top blocks and head trained (finetune.py): the
embeddings and lower blocks of two scorers are the same tensors, so for the same batch they compute the same
states. A steering cell is scored by its concept's scorer and its neighbours' (three over 200 texts in the default
run), which ran the six blocks three times: 22 of the steering stage's seconds. Here the first scorer of a group
runs its whole encoder once, keeping the input of the first trained block, and the others run from there, with
finetune's own `_run_from_block` (the path their training took). Scorers share a trunk only where their frozen
tensors, tokenizer and truncation are equal, checked, so each text's probability is the one `ScorerModel.score`
gives, bit for bit (tests/test_shared_trunk.py); any other scorer is scored alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from poolbench.extractor.loading import find_decoder_layers

from .finetune import _run_from_block
from .scorer_model import ScorerModel


def trained_from(scorer: ScorerModel) -> int | None:
    """The index of the scorer's first trained block (the lower ones are MiniLM's, frozen); None where its info
    does not say how many were trained."""
    if not isinstance(scorer, ScorerModel):  # a stand-in with a score(texts) of its own
        return None
    top = (scorer.info.get("config") or {}).get("train_top_layers")
    if not isinstance(top, int) or top < 1:
        return None
    n_layers = int(scorer.model.encoder.config.num_hidden_layers)
    return max(n_layers - top, 0)


def _frozen(scorer: ScorerModel, start: int) -> list[torch.Tensor]:
    encoder = scorer.model.encoder
    layers = find_decoder_layers(encoder, int(encoder.config.num_hidden_layers))
    modules = [encoder.base_model.embeddings, *list(layers)[:start]]
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]


def _config(scorer: ScorerModel) -> dict:
    """The encoder's config but the folder it was read from."""
    return {k: v for k, v in scorer.model.encoder.config.to_dict().items() if k != "_name_or_path"}


def _same_trunk(a: ScorerModel, b: ScorerModel, start: int) -> bool:
    """Whether b's frozen part (below block `start`, where both start training) computes what a's does."""
    if (a.max_length != b.max_length or type(a.model.encoder) is not type(b.model.encoder)
            or _config(a) != _config(b)):
        return False
    tok_a, tok_b = a.tokenizer.backend_tokenizer, b.tokenizer.backend_tokenizer  # type: ignore[attr-defined]
    if tok_a.to_str() != tok_b.to_str():
        return False
    ta, tb = _frozen(a, start), _frozen(b, start)
    return len(ta) == len(tb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


def trunk_groups(scorers: Mapping[str, ScorerModel]) -> list[list[str]]:
    """The scorers' names in groups that may share a trunk, in the order given; a group of one scores alone."""
    groups: list[list[str]] = []
    for name, scorer in scorers.items():
        start = trained_from(scorer)
        home = next((g for g in groups if start is not None and start > 0
                     and trained_from(scorers[g[0]]) == start and _same_trunk(scorers[g[0]], scorer, start)), None)
        if home is None:
            groups.append([name])
        else:
            home.append(name)
    return groups


@torch.no_grad()
def _score_group(scorers: Sequence[ScorerModel], texts: list[str], batch_size: int) -> list[np.ndarray]:
    lead = scorers[0]
    start = trained_from(lead)
    assert start is not None
    outs = [np.empty(len(texts), dtype=np.float64) for _ in scorers]
    followers = [(s, find_decoder_layers(s.model.encoder, int(s.model.encoder.config.num_hidden_layers)), out)
                 for s, out in zip(scorers[1:], outs[1:], strict=True)]
    for idx, enc in lead.batches(texts, batch_size):  # ScorerModel.score's batches, so its bits
        states = lead.model.encoder(**enc, output_hidden_states=True)
        outs[0][idx] = torch.sigmoid(lead.model.pooled_logit(states.last_hidden_state, enc["attention_mask"])
                                     .float()).numpy()
        cached = {"hidden": states.hidden_states[start]}
        for scorer, layers, out in followers:
            with _run_from_block(scorer.model.encoder, layers, start, cached):
                out[idx] = torch.sigmoid(scorer.model(**enc).float()).numpy()
    return outs


def _alone(scorer: ScorerModel, texts: list[str], batch_size: int) -> np.ndarray:
    return scorer.score(texts, batch_size) if isinstance(scorer, ScorerModel) else scorer.score(texts)


def score_texts(scorers: Mapping[str, ScorerModel], texts: Sequence[str], batch_size: int = 64
                ) -> dict[str, np.ndarray]:
    """{name: probabilities [len(texts)] in input order}, each equal to `scorers[name].score(texts, batch_size)`."""
    texts = list(texts)
    out: dict[str, np.ndarray] = {}
    for group in trunk_groups(scorers):
        if len(group) == 1 or not texts:
            out.update({name: _alone(scorers[name], texts, batch_size) for name in group})
            continue
        out.update(zip(group, _score_group([scorers[n] for n in group], texts, batch_size), strict=True))
    return {name: out[name] for name in scorers}
