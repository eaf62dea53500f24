"""What a run covers, as typed records the driver's stages take: every concept's passages and artifact keys, the
inputs read before any model loads, and the cells once the model is known."""

from __future__ import annotations

from dataclasses import dataclass

from poolbench.corpus.layout import Corpus
from poolbench.corpus.passage import Passage
from poolbench.pooler.spec import StrategySpec
from poolbench.store.artifact_store import ArtifactStore

from .variants import MAIN, Variant


@dataclass(frozen=True)
class ConceptPlan:
    """One concept's unit of work: its passages and, once the model is known, the keys of its artifacts."""

    concept: str
    passages: list[Passage]
    corpus_hash: str
    pooled_key: str = ""
    d1_key: str = ""
    dump_key: str | None = None
    variant: Variant = MAIN  # the activation site and context length its artifacts hold


@dataclass(frozen=True)
class RunInputs:
    """What a run reads before any model loads, so a bad corpus, strategy or store fails in seconds."""

    specs: list[StrategySpec]
    corpus: Corpus
    store_url: str
    store: ArtifactStore
    plans: list[ConceptPlan]


@dataclass(frozen=True)
class RunPlan:
    """The cells a run covers once the model is known: layers, strategies, and every concept's keys."""

    model: dict
    layers: list[int]
    specs: list[StrategySpec]
    plans: list[ConceptPlan]
    variant: Variant = MAIN

    @property
    def on_gpu(self) -> bool:
        """Whether the model runs on a CUDA device (the extractor's report of where it loaded it)."""
        return str(self.model.get("device", "cpu")).startswith("cuda")


PoolGroup = list[tuple[ConceptPlan, list[int]]]  # the concepts one pooling job shares forwards for, with their layers
