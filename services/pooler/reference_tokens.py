"""The reference code's token rules, registered as reference variants (reached by id only).

- L4_subword_root: a token-string rule, no parse. Over a passage's real tokens in order (special tokens
  included) it keeps the first token and every token that starts a word: in a passage with a WordPiece
  continuation ('##'), every token that is not one; otherwise every token whose string starts with '▁'
  (SentencePiece) or 'Ġ' (byte-level BPE). The strings come from the tokenizer (extras["token_root"]).
- L3_named_entity, L5_svo: spaCy words (inside an entity; dependency nsubj, nsubjpass, obj, dobj or ROOT), each
  mapped to ONE model token: the first token whose character span starts where the word starts, else the nearest
  token starting before it (special tokens, span (0, 0), never). Two words on one token count it twice.
Whitespace-only spaCy tokens are not in PoolBench's parses; the reference could select one (it never has an
entity, and spaCy gives it dependency 'dep'), so the selections agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poolbench.errors import StrategyError
from poolbench.pooler.linguistic import SVO_DEPS
from poolbench.pooler.spec import StrategySpec, TokenContext

WORD_INITIAL_PREFIXES = ("▁", "Ġ")
WORDPIECE_CONTINUATION = "##"


def subword_root_mask(pieces: Sequence[str]) -> np.ndarray:
    """[n] bool over one passage's token strings in order: the first, then each word-initial token."""
    wordpiece = any(p.startswith(WORDPIECE_CONTINUATION) for p in pieces)
    mask = np.array([not p.startswith(WORDPIECE_CONTINUATION) if wordpiece else p.startswith(WORD_INITIAL_PREFIXES)
                     for p in pieces], dtype=bool)
    if len(mask):
        mask[0] = True
    return mask


def token_root_extra(tokenizer, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """[B, T] bool extras["token_root"]: subword_root_mask of each row's real tokens, from the tokenizer's strings."""
    mask = np.asarray(attention_mask, dtype=bool)
    out = np.zeros(mask.shape, dtype=bool)
    for b in range(mask.shape[0]):
        real = np.flatnonzero(mask[b])
        out[b, real] = subword_root_mask(tokenizer.convert_ids_to_tokens(np.asarray(input_ids)[b, real].tolist()))
    return out


def subword_root_weights(ctx: TokenContext) -> np.ndarray:
    if "token_root" not in ctx.extras:
        raise StrategyError("batch has no extras['token_root']: this strategy needs 'tokens' at extraction")
    return np.asarray(ctx.extras["token_root"], dtype=bool)


def word_start_tokens(ctx: TokenContext, selected: np.ndarray) -> np.ndarray:
    """[B, T] counts: every selected word (a [W] bool over the batch's parse words) adds 1 to its one token."""
    weights = np.zeros(ctx.attention_mask.shape, dtype=np.float64)
    selected = np.asarray(selected, dtype=bool)
    starts, rows = ctx.extras["parse_start"], ctx.extras["parse_batch"]
    for b in np.unique(rows[selected]).tolist():
        spans = ctx.offsets[b]
        real = np.flatnonzero(ctx.attention_mask[b] & ((spans[:, 0] != 0) | (spans[:, 1] != 0)))
        token_starts, first = np.unique(spans[real, 0], return_index=True)  # first token per start
        nearest = np.searchsorted(token_starts, starts[selected & (rows == b)], side="right") - 1
        np.add.at(weights[b], real[first[nearest[nearest >= 0]]], 1.0)
    return weights


def _words(ctx: TokenContext, name: str) -> np.ndarray:
    missing = [key for key in (f"parse_{name}", "parse_start", "parse_batch") if key not in ctx.extras]
    if missing:
        raise StrategyError(f"batch has no {', '.join(missing)}: this strategy needs parses (needs='parse')")
    return np.asarray(ctx.extras[f"parse_{name}"])


def named_entity_weights(ctx: TokenContext) -> np.ndarray:
    return word_start_tokens(ctx, _words(ctx, "ent") >= 0)


def svo_weights(ctx: TokenContext) -> np.ndarray:
    return word_start_tokens(ctx, np.isin(_words(ctx, "dep").astype(str), sorted(SVO_DEPS)))


def _ref(strategy_id: str, fn, needs: str, description: str) -> StrategySpec:
    return StrategySpec(id=strategy_id, code=strategy_id.split("_", 1)[0], family="structural_linguistic",
                        kind="weights", weights_fn=fn, description=description, needs=frozenset({needs}),
                        reference_variant=True, version=2)


SPECS = (
    _ref("L3_named_entity", named_entity_weights, "parse",
         "Reference variant: mean of one token per spaCy entity word (the token starting at the word, else the "
         "nearest one before it)."),
    _ref("L4_subword_root", subword_root_weights, "tokens",
         "Reference variant: mean of the first token and every word-initial token by its string (WordPiece: not "
         "'##'; else a '▁' or 'Ġ' prefix)."),
    _ref("L5_svo", svo_weights, "parse",
         "Reference variant: mean of one token per word with dependency nsubj, nsubjpass, obj, dobj or ROOT (the "
         "token starting at the word, else the nearest one before it)."),
)
