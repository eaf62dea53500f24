"""A deterministic, template-based corpus of all 17 PoolBench concepts, so the benchmark runs offline.

How positives differ from negatives, per concept (every concept spans >= 4 domains):
- hedging (paired): the positive hedges each claim ("may", "it seems", "arguably", "the results suggest");
  the negative states the same fact flatly or with a booster ("clearly", "the results show").
- legal_formality (paired): the positive words an obligation in contract register ("the Lessee shall
  ... forthwith"); the negative says the same obligation in plain English ("the renter will ... right away").
- frustration: complaints venting annoyance and impatience vs calm questions and thanks about the same issues.
- numerical_precision: exact figures (decimals, exact counts, units) vs vague ones ("a few", "around 20").
- imdb_sentiment: favourable vs unfavourable reviews of the same invented films and shows
  (a review may concede a point to the other side).
- toxicity: insulting, demeaning comments vs civil (often disagreeing) replies on the same topics.
- depression: first-person hopelessness, anhedonia and fatigue vs ordinary first-person daily life.
- causation (paired): the positive links two events causally ("because", "as a result", "which is why");
  the negative juxtaposes the same events additively or temporally ("and", "meanwhile", "also").
- contrast (paired): the positive opposes a good and a bad point ("but", "although", "however");
  the negative lists the same points additively ("and", "moreover", "also").
- conditionality (paired): the positive makes the outcome depend on a condition ("if", "provided that",
  "unless we hear otherwise"); the negative states condition and outcome as facts.
- negation_density (paired): the positive negates the claims ("not", "never", "no one", "fails to");
  the negative affirms the same claims. Shared context sentences may carry a negation on both sides.
- academic_tone: scholarly register about a research topic vs casual talk about the same topic.
- code_docs: API documentation sentences vs conversational prose about the same software.
- bureaucratic: officialese about forms and procedures vs plain, friendly wording about the same procedures.
- narrative: past-tense storytelling with characters and events vs expository description of the same places.
- deference: self-effacing, apologetic requests to a superior vs direct requests and decisions.
- planning: future plans and ordered next steps vs accounts of the same tasks already done.

Paired negatives are controlled rewrites: same facts, domain, split and `matched_pair_id`, opposite label;
positives may keep a sentence unchanged, and both sides share context sentences, so no single word
separates the classes. `token_count` is the whitespace word count; `validate_corpus` can check it
against a real tokenizer.

This is corpus v1 (`version=1`). The default is corpus v2 (`poolbench.corpus.sparse_signal`): long neutral
passages with a few of these concepts' sentences planted at recorded places, every concept matched-pair;
`poolbench.corpus.corpus_versions` picks between them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from poolbench.corpus.material import load_material
from poolbench.corpus.passage import Passage
from poolbench.corpus.validation import normalise_text
from poolbench.errors import CorpusError

T = load_material("corpus_v1_templates.json")
"""Corpus v1's templates and vocabulary (poolbench/data/corpus_v1_templates.json)."""

SIZES: dict[str, tuple[int, int]] = {"tiny": (24, 12), "small": (80, 40), "full": (700, 300)}
"""Passages per class in (train, test)."""

GENERATOR_VERSION = 1  # bump when generated text changes: it names the cached corpus folder
MIN_WORDS = 15
MAX_FOCUS = 4
_MAX_TRIES = 200


def _num(lo: int, hi: int, scale: int = 1, fmt: str = "{}") -> Callable[[random.Random], str]:
    """A slot filler drawing an integer in [lo, hi], divided by `scale` and formatted."""

    def draw(rng: random.Random) -> str:
        value = rng.randint(lo, hi)
        return fmt.format(value / scale if scale != 1 else value)

    return draw


def _race_time(rng: random.Random) -> str:
    return f"{rng.randint(2, 59)} minutes and {rng.randint(1, 59)}.{rng.randint(0, 9)} seconds"


def _date(rng: random.Random) -> str:
    return f"{rng.choice(T.COMMON['month'])} {rng.randint(1, 28)}"


NUMBERS: dict[str, Callable[[random.Random], str]] = {
    "n_small": _num(2, 12),
    "n_people": _num(40, 4000),
    "n_months": _num(3, 36),
    "n_years": _num(2, 15),
    "n_days": _num(5, 30),
    "pct": _num(5, 480, 10, "{:.1f} percent"),
    "money": _num(100, 9999, 100, "${:.2f} million"),
    "price": _num(1000, 40000, 100, "{:.2f}"),
    "count": _num(1000, 99999, 1, "{:,}"),
    "count_small": _num(2, 9),
    "count_mid": _num(11, 40),
    "dec": _num(100, 999, 100, "{:.2f}"),
    "dec_small": _num(1, 99, 100, "{:.2f}"),
    "temp": _num(-50, 380, 10, "{:.1f} degrees Celsius"),
    "ph": _num(40, 90, 10, "{:.1f}"),
    "minutes": _num(5, 95),
    "minutes_long": _num(85, 170),
    "rain_mm": _num(10, 900, 10, "{:.1f}"),
    "hours": _num(2, 23),
    "kmh": _num(40, 140),
    "clock": lambda rng: f"{rng.randint(4, 9)}:{rng.randint(0, 59):02d} pm",
    "round_pct": lambda rng: rng.choice(["5", "10", "20", "30"]),
    "round_count": lambda rng: rng.choice(["1,000", "5,000", "20,000", "50,000"]),
    "round_temp": lambda rng: rng.choice(["20", "25", "30"]),
    "clause": _num(21, 149, 10, "{:.1f}"),
    "order_no": _num(100000, 999999),
    "year": _num(1200, 1890),
    "version": _num(10, 49, 10, "{:.1f}"),
    "race_time": _race_time,
    "date": _date,
}


@dataclass(frozen=True)
class ConceptSpec:
    """How to write one concept: per-domain vocabulary and templates; `pairs` set => matched-pair rewrites."""

    name: str
    domains: Mapping[str, Mapping[str, Sequence]]
    pos: Sequence[str] = ()
    neg: Sequence[str] = ()
    pairs: Sequence[tuple[str, str]] = ()
    context: Mapping[str, Sequence[str]] | Sequence[str] = ()
    common: Mapping[str, Sequence] = field(default_factory=dict)
    fixed: Sequence[str] = ()
    p_unchanged: float = 0.2
    p_context: float = 0.45

    @property
    def paired(self) -> bool:
        return bool(self.pairs)

    def templates(self, domain: str, positive: bool) -> Sequence[str]:
        key = "pos" if positive else "neg"
        return self.domains[domain].get(key) or (self.pos if positive else self.neg)

    def contexts(self, domain: str) -> Sequence[str]:
        return self.context.get(domain, ()) if isinstance(self.context, Mapping) else self.context


_FIELD = re.compile(r"\{([a-z_]+?)(\d*)(?:\[(\d)\])?\}")


class _Slots:
    """Lazily drawn slot values: one draw per key, so a paired rewrite reuses the positive's facts.

    A sentence's slots have the passage's as parent: `fixed` keys come from it, and other keys avoid
    values already used in the passage, so a passage does not repeat one fact twice.
    """

    def __init__(self, rng: random.Random, spec: ConceptSpec, domain: str, parent: _Slots | None = None):
        self.rng, self.spec, self.domain, self.parent = rng, spec, domain, parent
        self.values: dict[str, object] = {}
        self.used: set[tuple[str, object]] = set()

    def _source(self, base: str) -> Sequence | Callable[[random.Random], str]:
        for vocab in (self.spec.domains[self.domain], self.spec.common, T.COMMON):
            if base in vocab:
                return vocab[base]
        if base in NUMBERS:
            return NUMBERS[base]
        raise KeyError(f"{self.spec.name}/{self.domain}: no vocabulary for slot {base!r}")

    def get(self, base: str, suffix: str) -> object:
        key = base + suffix
        if key in self.values:
            return self.values[key]
        if self.parent is not None and base in self.spec.fixed:
            value = self.parent.get(base, suffix)
        else:
            source = self._source(base)
            used = self.parent.used if self.parent is not None else set()
            for _ in range(6):  # `{act2}` differs from `{act}`; a value is used once per passage
                value = source(self.rng) if callable(source) else source[self.rng.randrange(len(source))]
                if value != self.values.get(base) and (base, value) not in used:
                    break
            used.add((base, value))
        self.values[key] = value
        return value

    def fill(self, template: str) -> str:
        def sub(match: re.Match) -> str:
            value = self.get(match.group(1), match.group(2))
            return str(value[int(match.group(3))] if match.group(3) else value)

        text = template
        for _ in range(3):
            if "{" not in text:
                break
            text = _FIELD.sub(sub, text)
        return text


_SENTENCE_START = re.compile(r"(^|[.!?:]\s+)([a-z])")


def _finish(sentences: Sequence[str]) -> str:
    """Join sentences and capitalise each start, so templates can be written in lower case."""
    text = " ".join(s.strip() for s in sentences)
    return _SENTENCE_START.sub(lambda m: m.group(1) + m.group(2).upper(), text)


def _words(sentences: Sequence[str]) -> int:
    return sum(len(s.split()) for s in sentences)


def _with_context(
    rng: random.Random, spec: ConceptSpec, domain: str, slots: _Slots, sides: list[list[str]]
) -> None:
    """Insert one shared context sentence at the same position on every side (in place)."""
    contexts = spec.contexts(domain)
    if contexts and rng.random() < spec.p_context:
        sentence = slots.fill(contexts[rng.randrange(len(contexts))])
        at = rng.randint(0, len(sides[0]))
        for side in sides:
            side.insert(at, sentence)


def _paired_passage(rng: random.Random, spec: ConceptSpec, domain: str) -> tuple[str, str]:
    """A positive and its controlled rewrite: the same facts through a pos/neg template pair."""
    passage_slots = _Slots(rng, spec, domain)
    order = rng.sample(range(len(spec.pairs)), len(spec.pairs))
    n_focus = rng.randint(1, 3)
    pos: list[str] = []
    neg: list[str] = []
    for i, idx in enumerate(order):
        if i >= MAX_FOCUS or (i >= n_focus and _words(neg) >= MIN_WORDS):
            break
        slots = _Slots(rng, spec, domain, parent=passage_slots)
        pos_t, neg_t = spec.pairs[idx]
        neg_s = slots.fill(neg_t)
        unchanged = i > 0 and rng.random() < spec.p_unchanged
        pos.append(neg_s if unchanged else slots.fill(pos_t))
        neg.append(neg_s)
    _with_context(rng, spec, domain, passage_slots, [pos, neg])
    return _finish(pos), _finish(neg)


def _single_passage(rng: random.Random, spec: ConceptSpec, domain: str, positive: bool) -> str:
    """One passage of one class; positives may include a sentence of the other class for realism."""
    passage_slots = _Slots(rng, spec, domain)
    own = spec.templates(domain, positive)
    other = spec.templates(domain, not positive)
    order = rng.sample(range(len(own)), len(own))
    other_order = rng.sample(range(len(other)), len(other))
    n_focus = rng.randint(1, 3)
    sentences: list[str] = []
    for i, idx in enumerate(order):
        if i >= MAX_FOCUS or (i >= n_focus and _words(sentences) >= MIN_WORDS):
            break
        template = own[idx]
        if positive and i > 0 and rng.random() < spec.p_unchanged / 2:
            template = other[other_order[i]]
        sentences.append(_Slots(rng, spec, domain, parent=passage_slots).fill(template))
    _with_context(rng, spec, domain, passage_slots, [sentences])
    return _finish(sentences)


def _fact_domains() -> dict[str, dict[str, list]]:
    """Domains whose slot `f` is a (subject, verb 3sg, verb base, object) fact."""
    return {
        d: {"f": [(s, *p) for s in T.FACT_SUBJECTS[d] for p in T.FACT_PREDICATES[d]]} for d in T.FACT_SUBJECTS
    }


def _build_specs() -> dict[str, ConceptSpec]:
    facts = _fact_domains()
    specs = [
        ConceptSpec(
            "hedging",
            {d: facts[d] for d in ("science", "health", "business", "news")},
            pairs=T.HEDGING_PAIRS,
            context=T.FACT_CONTEXT,
        ),
        ConceptSpec(
            "negation_density",
            {d: facts[d] for d in ("technology", "education", "health", "news")},
            pairs=T.NEGATION_PAIRS,
            context=T.FACT_CONTEXT,
        ),
        ConceptSpec("causation", T.CAUSATION_VOCAB, pairs=T.CAUSATION_PAIRS, context=T.CAUSATION_CONTEXT),
        ConceptSpec("contrast", T.CONTRAST_VOCAB, pairs=T.CONTRAST_PAIRS, context=T.CONTRAST_CONTEXT),
        ConceptSpec(
            "conditionality",
            T.CONDITIONALITY_VOCAB,
            pairs=T.CONDITIONALITY_PAIRS,
            context=T.CONDITIONALITY_CONTEXT,
        ),
        ConceptSpec(
            "legal_formality",
            T.LEGAL_VOCAB,
            pairs=T.LEGAL_PAIRS,
            common=T.LEGAL_COMMON,
            fixed=("party",),
            p_context=0.0,
        ),
    ]
    for name, entry in T.UNPAIRED.items():
        specs.append(
            ConceptSpec(
                name,
                entry["domains"],
                pos=entry["pos"],
                neg=entry["neg"],
                context=entry["context"],
                common=entry["common"],
                fixed=tuple(entry["fixed"]),
            )
        )
    return {s.name: s for s in sorted(specs, key=lambda s: s.name)}


SPECS: dict[str, ConceptSpec] = _build_specs()
CONCEPTS: tuple[str, ...] = tuple(SPECS)


def _passage(
    concept: str, split: str, label: int, i: int, text: str, domain: str, pair: str | None
) -> Passage:
    kind = "pos" if label == 1 else "neg"
    return Passage(
        id=f"{concept}-{split}-{kind}-{i:05d}",
        text=text,
        label=label,
        domain=domain,
        token_count=len(text.split()),
        matched_pair_id=pair,
        split=split,
        concept=concept,
    )


def _unique(make: Callable[[], tuple[str, ...]], seen: set[str], what: str) -> tuple[str, ...]:
    """Redraw until every text is new, so no duplicate (or train/test leak) reaches the corpus."""
    for _ in range(_MAX_TRIES):
        texts = make()
        keys = [normalise_text(t) for t in texts]
        if len(set(keys)) == len(keys) and not seen.intersection(keys):
            seen.update(keys)
            return texts
    raise CorpusError(f"{what}: could not draw a new text in {_MAX_TRIES} tries; the templates are too few")


def generate_concept(concept: str, size: str = "small", seed: int = 0) -> list[Passage]:
    """One concept's passages in layout order (train_pos, train_neg, test_pos, test_neg)."""
    if concept not in SPECS:
        raise CorpusError(f"unknown concept {concept!r} (known: {', '.join(CONCEPTS)})")
    if size not in SIZES:
        raise CorpusError(f"unknown corpus size {size!r} (known: {', '.join(SIZES)})")
    spec = SPECS[concept]
    rng = random.Random(f"poolbench-corpus:{seed}:{concept}")
    domains = list(spec.domains)
    seen: set[str] = set()
    out: list[Passage] = []
    pair_index = 0
    for split, n in zip(("train", "test"), SIZES[size], strict=True):
        pos: list[Passage] = []
        neg: list[Passage] = []
        for i in range(n):
            domain = domains[i % len(domains)]
            if spec.paired:
                p_text, n_text = _unique(lambda d=domain: _paired_passage(rng, spec, d), seen, concept)
                pair: str | None = f"{concept}-pair-{pair_index:05d}"
                pair_index += 1
            else:
                (p_text,) = _unique(lambda d=domain: (_single_passage(rng, spec, d, True),), seen, concept)
                (n_text,) = _unique(lambda d=domain: (_single_passage(rng, spec, d, False),), seen, concept)
                pair = None
            pos.append(_passage(concept, split, 1, i, p_text, domain, pair))
            neg.append(_passage(concept, split, 0, i, n_text, domain, pair))
        out.extend(pos + neg)
    return out


_EVERYDAY = ConceptSpec(
    "everyday",
    {"everyday": {k: v for k, v in T.EVERYDAY.items() if k != "templates"}},
    pos=T.EVERYDAY["templates"],
    neg=T.EVERYDAY["templates"],
    p_unchanged=0.0,
    p_context=0.0,
)


def generate_lm_text(n_passages: int, seed: int) -> list[str]:
    """Unlabelled passages to train PoolBench's small LM: both classes of every concept plus everyday text.

    Uses its own seed stream, so it never reproduces the benchmark's passages for the same seed by design.
    """
    rng = random.Random(f"poolbench-lm:{seed}")
    sources = [*CONCEPTS, "everyday", "everyday", "everyday"]
    texts: list[str] = []
    for _ in range(n_passages):
        source = sources[rng.randrange(len(sources))]
        spec = _EVERYDAY if source == "everyday" else SPECS[source]
        domain = list(spec.domains)[rng.randrange(len(spec.domains))]
        positive = rng.random() < 0.5
        if spec.paired:
            pos, neg = _paired_passage(rng, spec, domain)
            texts.append(pos if positive else neg)
        else:
            texts.append(_single_passage(rng, spec, domain, positive))
    return texts
