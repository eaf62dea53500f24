"""Known-answer calibration: a concept family (outside the 17) whose pooling outcome is known before any model runs.

The same valence signal is planted in neutral context only at the start, only in the middle, only at the end,
as four sentences spread across the passage, or as one evaluative word; each expectation below says up front
which pooling must win where. A model or extractor that breaks them has an alignment, padding or hook bug, or
pools differently from what its name says. Those are wiring checks a random-weight model also passes; the
`trained_only` expectation (a valence word never seen in training, read by its meaning) is one it must fail.
Every passage has about the same length whatever its density, so density is not a proxy for length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from poolbench.corpus.embedded import ConceptSpec, _Slots
from poolbench.corpus.layout import write_corpus
from poolbench.corpus.material import load_material
from poolbench.corpus.passage import Passage
from poolbench.corpus.sparse_signal import neutral_context, planted_pair
from poolbench.corpus.token_count import count_tokens
from poolbench.corpus.validation import normalise_text
from poolbench.defaults import cache_dir
from poolbench.errors import CorpusError

ST = load_material("corpus_v2_signal.json")

REVISION = 3  # bump when generated text changes: it names the cached corpus folder (3: dense = four words, length
# level with one, unseen words)
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
    unseen: bool = False  # token plants only: test passages use evaluative words no training passage has


PLANTS: dict[str, Plant] = {
    "calibration_start": Plant("sentence", 1, "start"),
    "calibration_middle": Plant("sentence", 1, "middle"),
    "calibration_end": Plant("sentence", 1, "end"),
    "calibration_dense": Plant("token", 4, "spread"),
    "calibration_token": Plant("token", 1, "middle"),
    "calibration_unseen_words": Plant("token", 1, "middle", unseen=True),
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
    trained_only: bool = False  # needs what training gives (word meaning): a random-weight model must fail it


EXPECTATIONS: tuple[Expectation, ...] = (
    Expectation("start_window", "planted at the start, the first-k window beats the last-k window (W1 > W2)",
                "calibration_start", "W1_first_k", "calibration_start", "W2_last_k"),
    Expectation("end_window", "planted at the end, the last-k window beats the first-k window (W2 > W1)",
                "calibration_end", "W2_last_k", "calibration_end", "W1_first_k"),
    Expectation("end_last_token", "on a causal LM the last token sees a signal planted at the end (P1 > chance)",
                "calibration_end", "P1_last", causal_only=True),
    Expectation("density_mean", "the mean falls as density falls (A1 on four spread words > A1 on one word)",
                "calibration_dense", "A1_mean", "calibration_token", "A1_mean"),
    Expectation("sentence_vs_token", "one planted sentence beats one planted word under the mean (A1)",
                "calibration_middle", "A1_mean", "calibration_token", "A1_mean"),
    Expectation("unseen_words", "a valence word never seen in training is read by its meaning (A1 > chance)",
                "calibration_unseen_words", "A1_mean", trained_only=True),
)
CALIBRATION_STRATEGIES: tuple[str, ...] = tuple(dict.fromkeys(
    s for e in EXPECTATIONS for s in (e.strategy, e.versus_strategy) if s is not None))

_WORDS = ConceptSpec("calibration_words", {"calibration": ST.CONTEXT_VOCAB})


# Disjoint train and test evaluative words for `unseen` plants, (good, bad) each; many words per side, with shared
# endings ("-ful", "-ble", "-ly") on both labels, so a test word's spelling alone averages to no label.
UNSEEN_SPLIT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "train": (("wonderful", "lovely", "great", "pleasant", "charming", "splendid", "superb", "cheerful",
               "glorious", "marvellous", "gorgeous", "admirable"),
              ("terrible", "horrible", "awful", "nasty", "gloomy", "grim", "vile", "ugly", "dismal", "bleak",
               "rotten", "wretched")),
    "test": (("beautiful", "delightful", "perfect", "excellent", "brilliant", "lively", "sunny", "friendly",
              "graceful", "elegant", "fantastic", "magnificent"),
             ("dreadful", "miserable", "hideous", "gruesome", "foul", "shabby", "dreary", "filthy", "sombre",
              "appalling", "hateful", "ghastly")),
}


def _units(rng: random.Random, plant: Plant, split: str) -> list[tuple[str, str]]:
    """(positive, negative) signal units: whole sentences, or one frame whose single word flips valence."""
    if plant.kind == "sentence":
        return [ST.CALIBRATION_SENTENCES[i] for i in rng.sample(range(len(ST.CALIBRATION_SENTENCES)), plant.density)]
    good, bad = UNSEEN_SPLIT[split] if plant.unseen else ST.CALIBRATION_TOKEN_WORDS
    units = []
    for _ in range(plant.density):
        template = rng.choice(ST.CALIBRATION_TOKEN_FRAMES)
        frame = _Slots(rng, _WORDS, "calibration").fill(template.replace("{word}", "\x00"))
        units.append((frame.replace("\x00", rng.choice(good)), frame.replace("\x00", rng.choice(bad))))
    return units


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
                units = _units(rng, plant, split)
                beyond_one = sum(len(u[0].split()) for u in units[1:])  # signal words past one unit replace context
                context = neutral_context(rng, max(0, rng.randint(*CONTEXT_WORDS) - beyond_one))
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

