"""Ad-hoc request texts pooled the way the batch pipeline pools a corpus: one layer, one strategy."""

from __future__ import annotations

from poolbench.http.service_errors import RequestError
from poolbench.http.settings import ServiceSettings


def strategy_spec(strategy: str):
    """A strategy by id or short code, as a run resolves it (one line naming it when unknown)."""
    from poolbench.pooler.registry import resolve_strategies

    return resolve_strategies([strategy])[0]


def pool_texts(loaded, settings: ServiceSettings, texts: list[str], labels: list[int], splits: list[str],
               groups: list[str | None], layer: int, strategy: str):
    """A PooledTable (and ITIHeadTable) for ad-hoc texts: the batch pipeline's pooling, one layer and strategy."""
    from poolbench.corpus.passage import Passage
    from poolbench.pooler.concept_pooling import pool_concept_tables

    if layer >= loaded.n_layers:
        raise RequestError(f"layer: {layer} out of range for '{loaded.model_id}' ({loaded.n_layers} layers)")
    passages = [Passage(id=f"t{i}", text=t, label=y, domain="http", token_count=0, matched_pair_id=g,
                        split=s, concept="http") for i, (t, y, s, g) in enumerate(zip(texts, labels, splits, groups,
                                                                                       strict=True))]
    return pool_concept_tables(loaded, passages, [layer], [strategy_spec(strategy)], batch_size=settings.batch_size,
                               max_length=settings.max_length)
