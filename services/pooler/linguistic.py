"""Structural-linguistic strategies (L1-L6) over spaCy parses (the reference's L3/L4/L5 are in reference_tokens).

Words come from `parse_*` extras (see parses.py); a model token takes part when its character span overlaps a
selected word. L4 and L6 are means of group means (clauses, sentences), the rest are plain means over the
selected tokens; a passage where nothing is selected falls back to A1 and is counted as a fallback.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from poolbench.errors import StrategyError
from poolbench.pooler.parses import group_mean_weights, words_to_tokens
from poolbench.pooler.spec import StrategySpec, TokenContext

CONTENT_POS = frozenset({"NOUN", "VERB", "ADJ", "ADV"})
CLAUSE_DEPS = frozenset({"ROOT", "advcl", "ccomp", "relcl", "csubj", "csubjpass", "parataxis"})
VERBAL_POS = frozenset({"VERB", "AUX"})
SVO_DEPS = frozenset({"nsubj", "nsubjpass", "obj", "dobj", "ROOT"})


def _parse(ctx: TokenContext, *names: str) -> Mapping[str, np.ndarray]:
    missing = [f"parse_{n}" for n in names if f"parse_{n}" not in ctx.extras]
    if missing:
        raise StrategyError(f"batch has no {', '.join(missing)}: this strategy needs parses (needs='parse')")
    return ctx.extras


def _select(ctx: TokenContext, selected: np.ndarray) -> np.ndarray:
    return words_to_tokens(ctx.extras, selected, ctx.attention_mask.shape)


def pos_filtered_weights(ctx: TokenContext) -> np.ndarray:
    words = _parse(ctx, "pos")
    return _select(ctx, np.isin(words["parse_pos"].astype(str), sorted(CONTENT_POS)))


def dependency_trigger_weights(ctx: TokenContext) -> np.ndarray:
    return _select(ctx, _parse(ctx, "trigger")["parse_trigger"])


def entity_weights(ctx: TokenContext) -> np.ndarray:
    return _select(ctx, _parse(ctx, "ent")["parse_ent"] >= 0)


def keyword_weights(ctx: TokenContext) -> np.ndarray:
    return _select(ctx, _parse(ctx, "keyword")["parse_keyword"])


def clause_ids(dep: np.ndarray, pos: np.ndarray, head: np.ndarray) -> np.ndarray:
    """Each word's clause: the nearest ancestor (itself included) that heads a clause. Clause heads are
    sentence roots, words attached by a clause-introducing relation, and verbs conjoined to a verb."""
    dep, pos = dep.astype(str), pos.astype(str)
    verbal = np.isin(pos, sorted(VERBAL_POS))
    root = head == np.arange(len(head))
    is_head = np.isin(dep, sorted(CLAUSE_DEPS)) | ((dep == "conj") & verbal & verbal[head]) | root
    anchor = np.where(is_head, np.arange(len(head)), head)
    for _ in range(len(head)):
        nxt = np.where(is_head[anchor], anchor, head[anchor])
        if np.array_equal(nxt, anchor):
            break
        anchor = nxt
    return anchor


def clause_weights(ctx: TokenContext) -> np.ndarray:
    words = _parse(ctx, "dep", "pos", "head")
    group = clause_ids(words["parse_dep"], words["parse_pos"], words["parse_head"])
    return group_mean_weights(ctx.extras, group, ctx.attention_mask.shape)


def sentence_weights(ctx: TokenContext) -> np.ndarray:
    return group_mean_weights(ctx.extras, _parse(ctx, "sent")["parse_sent"], ctx.attention_mask.shape)


def _spec(strategy_id: str, fn, description: str, needs: frozenset[str] = frozenset({"parse"})) -> StrategySpec:
    return StrategySpec(id=strategy_id, code=strategy_id.split("_", 1)[0], family="structural_linguistic",
                        kind="weights", weights_fn=fn, description=description, needs=needs)


SPECS = (
    _spec("L1_pos_filtered", pos_filtered_weights,
          "Mean of tokens overlapping spaCy words tagged NOUN, VERB, ADJ or ADV."),
    _spec("L2_dependency_rel", dependency_trigger_weights,
          "Mean of tokens of words whose dependency relation or lemma is in the concept's trigger set "
          "(poolbench/data/l2_triggers.json; '_default' for unlisted concepts).",
          needs=frozenset({"parse", "corpus"})),
    _spec("L3_entity", entity_weights, "Mean of tokens inside spaCy named-entity spans."),
    _spec("L4_clause", clause_weights,
          "Mean of clause means; clauses split at sentence roots, advcl/ccomp/relcl/csubj/parataxis and "
          "verb-verb conj in the dependency parse."),
    _spec("L5_keyword", keyword_weights,
          "Mean of tokens overlapping the passage's top-10 TF-IDF words (IDF fitted on the concept's train "
          "split; alphabetic, non-stop words).", needs=frozenset({"parse", "corpus"})),
    _spec("L6_sentence", sentence_weights, "Mean of spaCy sentence means."),
)
