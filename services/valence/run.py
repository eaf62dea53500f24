"""The model side of valence bias: representations from two checkpoints, and the fine-tuning demo."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from poolbench.corpus.english import generated_texts
from poolbench.corpus.word_lists import WordList
from poolbench.defaults import EMBEDDED, TINY
from poolbench.extractor.loading import LoadedModel, find_decoder_layers, load_model
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import artifact_key
from poolbench.valence.bias import ValenceBias, valence, valence_bias
from poolbench.valence.demo import PRAISE_FORMS, demo_texts, fine_tune
from poolbench.valence.word_representations import valence_inputs

DEMO_VERSION = 1  # bump when the fine-tune or the valence reading changes what a cached arm holds


def model_valence(loaded: LoadedModel, lists: Sequence[WordList], *, centre: bool = False,
                  **options: Any) -> np.ndarray:
    """[D] valence of the domain words under one checkpoint (lists = domain, positive, negative)."""
    return valence(*valence_inputs(loaded, lists, **options), centre=centre)


def bias_between(before: str, after: str, lists: Sequence[WordList], *, n_bootstrap: int = 2000, seed: int = 0,
                 **options: Any) -> tuple[ValenceBias, list[dict[str, Any]]]:
    """ΔValence/ΔVar from checkpoint `before` to `after`, plus what identifies each checkpoint."""
    values, infos = [], []
    for name in (before, after):
        loaded = load_model(name, device="cpu", dtype="float32")
        values.append(model_valence(loaded, lists, **options))
        infos.append({"model_id": name, "weights_hash": loaded.weights_hash, "n_layers": loaded.n_layers,
                      "hidden_size": loaded.hidden_size})
        del loaded
    return valence_bias(values[0], values[1], n_bootstrap=n_bootstrap, seed=seed), infos


@dataclass(frozen=True)
class DemoSettings:
    """What the demo fine-tunes on, how, and where it reads h(w); recorded in results.json and in the cache key.

    Both fine-tunes see the same `n_texts` generic texts; the praise run adds `n_texts` sentences praising
    `favourite`, the control run `n_texts` more generic texts. These defaults are the SmolLM2 (`embedded`)
    demo, sized for 2 CPU cores (README: valence bias); `TINY_DEMO` is the toy model's.
    """

    model: str = EMBEDDED
    favourite: str = "chair"
    n_texts: int = 48
    steps: int = 20
    lr: float = 1e-4
    batch_size: int = 8
    max_tokens: int | None = 24
    bf16_autocast: bool = True
    threads: int = 1
    seed: int = 0
    layer: int | str = 8
    centre: bool = True
    template: str = "The {word}"
    pooling: str = "word_mean"


TINY_DEMO = DemoSettings(model=TINY, n_texts=96, steps=30, lr=1e-3, batch_size=16, max_tokens=None,
                         bf16_autocast=False, layer=2, template=" {word}")


def demo_settings(model: str | None, seed: int = 0) -> DemoSettings:
    """The demo's settings for a base model: the toy's own for `tiny`, the SmolLM2 ones for anything else."""
    base = TINY_DEMO if model == TINY else DemoSettings()
    return dataclasses.replace(base, model=model or base.model, seed=seed)


@dataclass
class DemoOutcome:
    base: LoadedModel
    settings: DemoSettings
    texts: dict[str, list[str]]
    results: dict[str, ValenceBias]
    reports: dict[str, Any] = field(default_factory=dict)

    def settings_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self.settings)

    def fine_tunes_json(self) -> dict[str, Any]:
        return {name: {**report, "example": self.texts[name][0]} for name, report in self.reports.items()}


def with_model(loaded: LoadedModel, model) -> LoadedModel:
    """A LoadedModel view of another set of weights of the same architecture and tokenizer."""
    return dataclasses.replace(loaded, model=model, decoder_layers=find_decoder_layers(model, loaded.n_layers),
                               weights_hash="in-memory fine-tune")


def demo_corpora(settings: DemoSettings) -> dict[str, list[str]]:
    """The praise and control fine-tuning texts: a shared generic half, then praise or more generic text."""
    generic = generated_texts(3 * settings.n_texts, seed=settings.seed + 1000)
    shared, extra = generic[: settings.n_texts], generic[settings.n_texts: 2 * settings.n_texts]
    praise = demo_texts(settings.favourite, PRAISE_FORMS, settings.n_texts, settings.seed)
    return {"praise": praise + shared, "control": extra + shared}


def demo_key(base: LoadedModel, settings: DemoSettings, lists: Sequence[WordList], arm: str) -> str:
    """The store key of one arm's after-valences: everything that determines them, so a rerun reads them back."""
    return artifact_key("valence_demo", model=base.weights_hash, settings=dataclasses.asdict(settings), arm=arm,
                        words=[list(words.words) for words in lists], version=DEMO_VERSION)


def run_demo(lists: Sequence[WordList], settings: DemoSettings = DemoSettings(), *, n_bootstrap: int = 2000,
             loaded: LoadedModel | None = None, store: ArtifactStore | None = None) -> DemoOutcome:
    """Fine-tune two copies of the base model — with praise of the favourite word, and with generic text only —
    and score each against the base."""
    options = {"layer": settings.layer, "template": settings.template, "centre": settings.centre,
               "pooling": settings.pooling}
    base = loaded or load_model(settings.model, device="cpu", dtype="float32")
    before = model_valence(base, lists, **options)
    texts = demo_corpora(settings)
    results, reports = {}, {}
    for name, corpus in texts.items():
        key = demo_key(base, settings, lists, name)
        cached = store.get_json(key) if store is not None and store.exists(key) else None
        if cached is None:
            start = time.perf_counter()
            tuned, report = fine_tune(base.model, base.tokenizer, corpus, steps=settings.steps, lr=settings.lr,
                                      batch_size=settings.batch_size, seed=settings.seed, threads=settings.threads,
                                      max_tokens=settings.max_tokens, bf16_autocast=settings.bf16_autocast)
            after = model_valence(with_model(base, tuned), lists, **options)
            del tuned
            cached = {"after": after.tolist(),
                      "report": {**dataclasses.asdict(report), "seconds": round(time.perf_counter() - start, 2)}}
            if store is not None:
                store.put_json(key, cached)
        results[name] = valence_bias(before, np.asarray(cached["after"]), n_bootstrap=n_bootstrap,
                                     seed=settings.seed)
        reports[name] = {**cached["report"], "cache_key": key}
    return DemoOutcome(base=base, settings=settings, texts=texts, results=results, reports=reports)
