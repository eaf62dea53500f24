"""Known-answer calibration: a concept family (outside the 17) whose pooling outcome is known before any model runs.

The same valence signal is planted in neutral context only at the start, only in the middle, only at the end,
as four sentences spread across the passage, or as one evaluative word; each expectation below says up front
which pooling must win where. A model or extractor that breaks them has an alignment, padding or hook bug, or
pools differently from what its name says.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from poolbench.config import cache_dir
from poolbench.corpus.embedded import ConceptSpec, _Slots
from poolbench.corpus.layout import write_corpus
from poolbench.corpus.material import load_material
from poolbench.corpus.passage import Passage
from poolbench.corpus.sparse_signal import neutral_context, planted_pair
from poolbench.corpus.token_count import count_tokens
from poolbench.corpus.validation import normalise_text
from poolbench.errors import CorpusError

ST = load_material("corpus_v2_signal.json")

REVISION = 1  # bump when generated text changes: it names the cached corpus folder
SIZE = (48, 24)
"""Matched pairs per calibration concept in (train, test)."""
CONTEXT_WORDS = (60, 90)
DOMAINS = ("town", "village", "harbour")
_MAX_TRIES = 50


@dataclass(frozen=True)
class Plant:
    """How one calibration concept plants its signal: a `sentence` or one `token`, how many, and where."""

    kind: str
    density: int
    placement: str


PLANTS: dict[str, Plant] = {
    "calibration_start": Plant("sentence", 1, "start"),
    "calibration_middle": Plant("sentence", 1, "middle"),
    "calibration_end": Plant("sentence", 1, "end"),
    "calibration_dense": Plant("sentence", 4, "spread"),
    "calibration_token": Plant("token", 1, "middle"),
}
CALIBRATION_CONCEPTS: tuple[str, ...] = tuple(PLANTS)


@dataclass(frozen=True)
class Expectation:
    """AUROC(concept, strategy) minus AUROC(versus), which must be > 0; `versus` None means chance (0.5)."""

    id: str
    statement: str
    concept: str
    strategy: str
    versus_concept: str | None = None
    versus_strategy: str | None = None
    causal_only: bool = False


EXPECTATIONS: tuple[Expectation, ...] = (
    Expectation("start_window", "planted at the start, the first-k window beats the last-k window (W1 > W2)",
                "calibration_start", "W1_first_k", "calibration_start", "W2_last_k"),
    Expectation("end_window", "planted at the end, the last-k window beats the first-k window (W2 > W1)",
                "calibration_end", "W2_last_k", "calibration_end", "W1_first_k"),
    Expectation("end_last_token", "on a causal LM the last token sees a signal planted at the end (P1 > chance)",
                "calibration_end", "P1_last", causal_only=True),
    Expectation("density_mean", "the mean falls as density falls (A1 on four spread sentences > A1 on one)",
                "calibration_dense", "A1_mean", "calibration_middle", "A1_mean"),
    Expectation("sentence_vs_token", "one planted sentence beats one planted word under the mean (A1)",
                "calibration_middle", "A1_mean", "calibration_token", "A1_mean"),
)
CALIBRATION_STRATEGIES: tuple[str, ...] = tuple(dict.fromkeys(
    s for e in EXPECTATIONS for s in (e.strategy, e.versus_strategy) if s is not None))

_WORDS = ConceptSpec("calibration_words", {"calibration": ST.CONTEXT_VOCAB})


def _units(rng: random.Random, plant: Plant) -> list[tuple[str, str]]:
    """(positive, negative) signal units: whole sentences, or one frame whose single word flips valence."""
    if plant.kind == "sentence":
        return [ST.CALIBRATION_SENTENCES[i] for i in rng.sample(range(len(ST.CALIBRATION_SENTENCES)), plant.density)]
    template = rng.choice(ST.CALIBRATION_TOKEN_FRAMES).replace("{word}", "\x00")
    frame = _Slots(rng, _WORDS, "calibration").fill(template)
    good, bad = ST.CALIBRATION_TOKEN_WORDS
    return [(frame.replace("\x00", rng.choice(good)), frame.replace("\x00", rng.choice(bad)))]


def generate_calibration_concept(concept: str, seed: int = 0) -> list[Passage]:
    """One calibration concept's matched pairs in layout order; spans mark the planted sentence(s)."""
    if concept not in PLANTS:
        raise CorpusError(f"unknown calibration concept {concept!r} (known: {', '.join(CALIBRATION_CONCEPTS)})")
    plant = PLANTS[concept]
    rng = random.Random(f"poolbench-calibration:{seed}:{concept}")
    seen: set[str] = set()
    out: list[Passage] = []
    pair_index = 0
    for split, n in zip(("train", "test"), SIZE, strict=True):
        pos: list[Passage] = []
        neg: list[Passage] = []
        for i in range(n):
            for _ in range(_MAX_TRIES):
                units = _units(rng, plant)
                context = neutral_context(rng, rng.randint(*CONTEXT_WORDS))
                (p_text, p_spans), (n_text, n_spans) = planted_pair(context, units, plant.placement, rng)
                keys = {normalise_text(p_text), normalise_text(n_text)}
                if len(keys) == 2 and not seen.intersection(keys):
                    seen.update(keys)
                    break
            else:
                raise CorpusError(f"{concept}: could not draw a new pair in {_MAX_TRIES} tries")
            p_tokens, n_tokens = count_tokens([p_text, n_text])
            pair_id = f"{concept}-pair-{pair_index:05d}"
            domain = DOMAINS[i % len(DOMAINS)]
            for side, label, text, spans, tokens in ((pos, 1, p_text, p_spans, p_tokens),
                                                     (neg, 0, n_text, n_spans, n_tokens)):
                side.append(Passage(id=f"{concept}-{split}-{'pos' if label else 'neg'}-{i:05d}", text=text,
                                    label=label, domain=domain, token_count=tokens, matched_pair_id=pair_id,
                                    split=split, concept=concept, signal_spans=spans, density=plant.density,
                                    placement=plant.placement))
            pair_index += 1
        out.extend(pos + neg)
    return out


def generate_calibration_corpus(seed: int = 0) -> dict[str, list[Passage]]:
    """Every calibration concept; byte-identical for the same seed on every run and machine."""
    return {concept: generate_calibration_concept(concept, seed) for concept in CALIBRATION_CONCEPTS}


def calibration_corpus_dir(seed: int = 0) -> Path:
    """Generate the calibration corpus once into the cache, in the PoolBench layout, named by its revision."""
    root = cache_dir() / "corpora" / f"calibration-r{REVISION}-seed{seed}"
    if not root.exists():
        write_corpus(root, generate_calibration_corpus(seed))
    return root

