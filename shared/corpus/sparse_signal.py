"""Corpus v2: long neutral passages with a few concept-bearing sentences at known places, every concept paired.

A v1 passage is 15-90 words in which every sentence carries the concept, so on a real model every pooling
strategy reaches the ceiling. A v2 passage is neutral context (shared by both classes, CONTEXT_TEMPLATES
in corpus_v2_signal.json) with `density` = 1-4 signal sentences placed at the `start`, in the
`middle`, at the `end` or `spread` across it. The negative is the controlled rewrite of the same signal sentences
in the same context at the same places (same domain, split and `matched_pair_id`), so only the concept differs.
Density and placement are scheduled in balanced blocks per concept and recorded per record with the signal
sentences' character spans (a split's pool or the hard tier may cap the density; the record says the actual one).
Per concept, what a signal sentence does and what its rewrite removes:

- hedging: hedges a claim ("may", "it seems", "the results suggest"); the rewrite states the same fact flatly.
- negation_density: negates a claim ("not", "never", "no one"); the rewrite affirms the same claim.
- causation: links two events causally ("because", "as a result"); the rewrite juxtaposes them ("and", "also").
- contrast: opposes a good and a bad point ("but", "although"); the rewrite lists them additively.
- conditionality: makes an outcome depend on a condition ("if", "provided that"); the rewrite states both as facts.
- legal_formality: words an obligation in contract register ("shall ... forthwith"); the rewrite in plain English.
- frustration: vents annoyance and impatience about an issue; the rewrite asks or reports the same issue calmly.
- toxicity: insults or demeans a person; the rewrite addresses the same person and topic civilly.
- depression: voices hopelessness, anhedonia or exhaustion; the rewrite tells the same day as ordinary.
- academic_tone: argues a research claim in scholarly register; the rewrite says it as casual talk.
- code_docs: documents an API (returns, raises, defaults); the rewrite chats about the same objects and settings.
- bureaucratic: officialese ("hereby", "in accordance with"); the rewrite says the same step plainly.
- narrative: tells past events with a character; the rewrite describes the same place in the timeless present.
- deference: asks a superior with apology and self-effacement; the rewrite asks or decides directly.
- planning: lays out future steps and intentions; the rewrite reports the same tasks as already done.
- imdb_sentiment: praises an aspect of a film (acting, script, music); the rewrite pans the same aspect.
- numerical_precision: gives exact figures (decimals, counts, units); the rewrite gives the same fact vaguely.

Two tiers (`tier` on every record). A `standard` pair plants the rewrites above. A `hard` pair plants one unit
whose positive and negative hold the same words and differ only in what they mean together (corpus_v2_hard.json):
hand-written pairs per concept (negation scope, which claim a doubt attaches to, a causal link asserted or denied,
who decides...) and, for every concept, framed pairs that assert one of a standard pair's sentences and quote or
dismiss the other. A bag of words sees a hard pair as one text, so the lexical baseline is at chance there.

Held out: train and test draw signal templates, hard pairs, frames and slot fillers from disjoint halves of each
pool (`split_pool`), so no test signal sentence occurs in train; the written corpus's manifest says so and
`validate-corpus` makes any shared sentence an error for it. Numbers are drawn fresh in both splits.

`token_count` is counted with the default model's tokenizer (`poolbench.corpus.token_count`); every passage
holds MIN_TOKENS..MAX_TOKENS tokens, inside the default 256-token window, so no signal is truncated away.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import product

from poolbench.corpus.embedded import _SENTENCE_START, CONCEPTS, SPECS, ConceptSpec, T, _Slots
from poolbench.corpus.material import load_material
from poolbench.corpus.passage import PLACEMENTS, SPLITS, TIERS, Passage
from poolbench.corpus.token_count import count_tokens
from poolbench.corpus.validation import normalise_text
from poolbench.errors import CorpusError

ST = load_material("corpus_v2_signal.json")
"""Corpus v2's signal rewrites and neutral context (poolbench/data/corpus_v2_signal.json)."""

HARD = load_material("corpus_v2_hard.json")
"""The hard tier's hand-written pairs and frames (poolbench/data/corpus_v2_hard.json)."""

REVISION = 2  # bump when generated text changes: it names the cached corpus folder
SIZES: dict[str, dict[str, tuple[int, int]]] = {
    "tiny": {"standard": (16, 4), "hard": (8, 8)},
    "small": {"standard": (12, 6), "hard": (6, 8)},
    "full": {"standard": (500, 150), "hard": (200, 150)},
}
"""Matched pairs per tier in (train, test). `small`, the default run's, holds 32 pairs per concept in about the
tokens its former 24 had (passages are shorter), so the run keeps its CPU budget: 8 hard test pairs give the hard
tier an interval, 12 + 6 standard pairs keep the steering scorers (trained on the standard tier) valid. `tiny`
keeps the 24 + 12 pairs the pipeline tests were written for."""
DENSITIES: tuple[int, ...] = (1, 2, 3, 4)
MAX_HARD_DENSITY = 1
"""A hard unit is two sentences' worth of words (a frame holds both sides), so a hard passage carries one: the
passage stays mostly context."""
MIN_TOKENS, MAX_TOKENS = 100, 200
PASSAGE_WORDS = (80, 125)
"""Words per passage, signal included (uniform): neutral context fills what the signal leaves, so the tiers and the
densities do not differ in length; about 100-200 tokens."""
MIN_CONTEXT_WORDS = 55
_MAX_TRIES = 50

CONTEXT_SPEC = ConceptSpec("context", {"context": ST.CONTEXT_VOCAB})


def split_pool(items: Sequence, split: str) -> list:
    """The split's share of a template or filler pool: train takes the even positions, test the odd ones, so no
    template or filler is shared; a pool of one is left whole (its sentence still differs by its other slots)."""
    if len(items) < 2:
        return list(items)
    return [x for i, x in enumerate(items) if i % 2 == (split == "test")]


def _split_vocab(vocab: Mapping[str, Sequence], split: str) -> dict[str, list]:
    return {key: split_pool(values, split) for key, values in vocab.items()}


def split_spec(spec: ConceptSpec, split: str) -> ConceptSpec:
    """The concept's slot vocabulary restricted to the split's fillers (numbers are drawn fresh, not pooled)."""
    context = spec.context
    context = ({d: split_pool(c, split) for d, c in context.items()} if isinstance(context, Mapping)
               else split_pool(context, split))
    return replace(spec, domains={d: _split_vocab(v, split) for d, v in spec.domains.items()},
                   common={**_split_vocab(T.COMMON, split), **_split_vocab(spec.common, split)}, context=context)


def framed_pairs(pairs: Sequence[tuple[str, str]], frames: Sequence[str]) -> list[tuple[str, str]]:
    """Hard pairs from standard ones: the positive asserts the concept sentence and quotes its rewrite, the
    negative the reverse, so both hold the same words."""
    def quoted(sentence: str) -> str:
        return sentence.rstrip(".")

    return [(frame.replace("<A>", pos).replace("<B>", quoted(neg)),
             frame.replace("<A>", neg).replace("<B>", quoted(pos))) for frame in frames for pos, neg in pairs]


@dataclass(frozen=True)
class SignalSource:
    """One split's slot vocabulary and, per domain, its standard (positive, rewrite) pairs, its hand-written hard
    pairs and its framed hard pairs; train and test sources share no template and no filler."""

    spec: ConceptSpec
    pairs: Mapping[str, Sequence[tuple[str, str]]]
    hard: Sequence[tuple[str, str]] = ()
    framed: Mapping[str, Sequence[tuple[str, str]]] = field(default_factory=dict)


def _sources(split: str) -> dict[str, SignalSource]:
    sources = {}
    frames = split_pool(HARD.FRAMES, split)
    for name in CONCEPTS:
        spec = SPECS[name]
        if name == "numerical_precision":
            by_domain: Mapping[str, Sequence[tuple[str, str]]] = ST.NUMERICAL_REWRITES
        else:
            shared = spec.pairs if spec.paired else ST.REWRITES[name]
            by_domain = {domain: shared for domain in spec.domains}
        pairs = {domain: split_pool(p, split) for domain, p in by_domain.items()}
        sources[name] = SignalSource(split_spec(spec, split), pairs,
                                     split_pool(HARD.HARD_PAIRS.get(name, ()), split),
                                     {domain: framed_pairs(p, frames) for domain, p in pairs.items()})
    return sources


SOURCES: dict[str, dict[str, SignalSource]] = {split: _sources(split) for split in SPLITS}
"""Per split, per concept: where its signal sentences come from."""


def _words(sentences: Sequence[str]) -> int:
    return sum(len(s.split()) for s in sentences)


def signal_positions(n_sentences: int, density: int, placement: str, rng: random.Random) -> list[int]:
    """Indices of the signal sentences among `n_sentences`; `spread` of one sentence is a random inner slot."""
    if placement == "start":
        return list(range(density))
    if placement == "end":
        return list(range(n_sentences - density, n_sentences))
    if placement == "middle":
        first = (n_sentences - density) // 2
        return list(range(first, first + density))
    if placement == "spread":
        if density == 1:
            return [rng.randint(1, n_sentences - 2)]
        return [round(i * (n_sentences - 1) / (density - 1)) for i in range(density)]
    raise CorpusError(f"unknown placement {placement!r} (known: {', '.join(PLACEMENTS)})")


def join_sentences(sentences: Sequence[str], signal: Sequence[int]) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The passage text (sentence starts capitalised) and the character spans of the sentences in `signal`."""
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    offset = 0
    wanted = set(signal)
    for i, sentence in enumerate(sentences):
        text = _SENTENCE_START.sub(lambda m: m.group(1) + m.group(2).upper(), sentence.strip())
        if i:
            offset += 1
        if i in wanted:
            spans.append((offset, offset + len(text)))
        parts.append(text)
        offset += len(text)
    return " ".join(parts), tuple(spans)


def neutral_context(rng: random.Random, n_words: int, extra: Sequence[str] = ()) -> list[str]:
    """Shuffled neutral sentences (plus `extra`) totalling at least `n_words` words."""
    passage_slots = _Slots(rng, CONTEXT_SPEC, "context")
    order = rng.sample(range(len(ST.CONTEXT_TEMPLATES)), len(ST.CONTEXT_TEMPLATES))
    sentences = list(extra)
    for idx in order:
        if _words(sentences) >= n_words:
            break
        sentences.append(_Slots(rng, CONTEXT_SPEC, "context", parent=passage_slots).fill(ST.CONTEXT_TEMPLATES[idx]))
    rng.shuffle(sentences)
    return sentences


def planted_pair(context: Sequence[str], units: Sequence[tuple[str, str]], placement: str,
                 rng: random.Random) -> tuple[tuple[str, tuple], tuple[str, tuple]]:
    """(text, spans) of the positive and of its rewrite: the same context, the units at the same places."""
    n = len(context) + len(units)
    positions = signal_positions(n, len(units), placement, rng)
    sides = []
    for side in (0, 1):
        rest = iter(context)
        unit = iter(u[side] for u in units)
        sentences = [next(unit) if i in positions else next(rest) for i in range(n)]
        sides.append(join_sentences(sentences, positions))
    return sides[0], sides[1]


def _templates(rng: random.Random, source: SignalSource, domain: str, density: int,
               tier: str) -> list[tuple[str, str]]:
    """`density` distinct (positive, rewrite) templates of the tier; hard units are hand-written or framed at even
    odds where the concept has hand-written ones."""
    if tier == "standard":
        pairs = source.pairs[domain]
        return [pairs[i] for i in rng.sample(range(len(pairs)), min(density, len(pairs)))]
    hand, framed = list(source.hard), list(source.framed[domain])
    chosen: list[tuple[str, str]] = []
    while len(chosen) < min(density, MAX_HARD_DENSITY):
        pool = hand if hand and (not framed or rng.random() < 0.5) else framed
        chosen.append(pool.pop(rng.randrange(len(pool))))
    return chosen


def _draw_pair(rng: random.Random, source: SignalSource, domain: str, density: int, placement: str,
               tier: str = "standard") -> tuple[tuple[str, tuple], tuple[str, tuple]]:
    spec = source.spec
    passage_slots = _Slots(rng, spec, domain)
    units = []
    for pos_t, neg_t in _templates(rng, source, domain, density, tier):
        slots = _Slots(rng, spec, domain, parent=passage_slots)
        units.append((slots.fill(pos_t), slots.fill(neg_t)))
    own = spec.contexts(domain)
    extra = [passage_slots.fill(own[rng.randrange(len(own))])] if own and rng.random() < 0.5 else []
    n_context = max(MIN_CONTEXT_WORDS, rng.randint(*PASSAGE_WORDS) - _words([u[0] for u in units]))
    context = neutral_context(rng, n_context, extra)
    return planted_pair(context, units, placement, rng)


def balanced_schedule(rng: random.Random, n: int) -> list[tuple[int, str]]:
    """(density, placement) for n pairs: every combination once per block of 16, in shuffled order."""
    combos = list(product(DENSITIES, PLACEMENTS))
    schedule: list[tuple[int, str]] = []
    while len(schedule) < n:
        schedule.extend(rng.sample(combos, len(combos)))
    return schedule[:n]


def draw_unique_pair(make: Callable[[], tuple[tuple[str, tuple], tuple[str, tuple]]], seen: set[str],
                     what: str) -> tuple[tuple[str, tuple, int], tuple[str, tuple, int]]:
    """Redraw until both texts are new and within the token window; returns (text, spans, tokens) per side."""
    for _ in range(_MAX_TRIES):
        (p_text, p_spans), (n_text, n_spans) = make()
        keys = {normalise_text(p_text), normalise_text(n_text)}
        if len(keys) < 2 or seen.intersection(keys):
            continue
        p_tokens, n_tokens = count_tokens([p_text, n_text])
        if all(MIN_TOKENS <= t <= MAX_TOKENS for t in (p_tokens, n_tokens)):
            seen.update(keys)
            return (p_text, p_spans, p_tokens), (n_text, n_spans, n_tokens)
    raise CorpusError(f"{what}: no new pair within {MIN_TOKENS}-{MAX_TOKENS} tokens in {_MAX_TRIES} tries")


def generate_concept_v2(concept: str, size: str = "small", seed: int = 0) -> list[Passage]:
    """One concept's v2 passages in layout order (train_pos, train_neg, test_pos, test_neg), standard pairs before
    hard ones within each file; train and test draw from disjoint template and filler pools."""
    if concept not in CONCEPTS:
        raise CorpusError(f"unknown concept {concept!r} (known: {', '.join(CONCEPTS)})")
    if size not in SIZES:
        raise CorpusError(f"unknown corpus size {size!r} (known: {', '.join(SIZES)})")
    rng = random.Random(f"poolbench-corpus-v2:{seed}:{concept}")
    domains = list(SPECS[concept].domains)
    counts = SIZES[size]
    schedule = balanced_schedule(rng, sum(n for tier in TIERS for n in counts[tier]))
    seen: set[str] = set()
    out: list[Passage] = []
    pair_index = 0
    for s_index, split in enumerate(SPLITS):
        source = SOURCES[split][concept]
        sides: tuple[list[Passage], list[Passage]] = ([], [])
        i = 0
        for tier in TIERS:
            for j in range(counts[tier][s_index]):
                domain = domains[j % len(domains)]
                density, placement = schedule[pair_index]
                pair_id = f"{concept}-pair-{pair_index:05d}"
                drawn = draw_unique_pair(
                    lambda s=source, d=domain, k=density, p=placement, t=tier: _draw_pair(rng, s, d, k, p, t), seen,
                    concept)
                for label, (text, spans, tokens), side in zip((1, 0), drawn, sides, strict=True):
                    kind = "pos" if label == 1 else "neg"
                    side.append(Passage(id=f"{concept}-{split}-{kind}-{i:05d}", text=text, label=label,
                                        domain=domain, token_count=tokens, matched_pair_id=pair_id, split=split,
                                        concept=concept, signal_spans=spans, density=len(spans),
                                        placement=placement, tier=tier))
                pair_index += 1
                i += 1
        out.extend(sides[0] + sides[1])
    return out


def generate_corpus_v2(size: str = "small", seed: int = 0) -> dict[str, list[Passage]]:
    """All 17 concepts of corpus v2; byte-identical for the same (size, seed) on every run and machine."""
    return {concept: generate_concept_v2(concept, size, seed) for concept in CONCEPTS}
