"""Deep checks of a corpus folder, reported as findings (never raised) so one run lists every defect.

Errors are defects that make a probe result untrustworthy (leakage, label noise, broken pairs);
warnings are smells worth a look (imbalance, stale token counts, duplicates within one class).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

from rich.table import Table

from poolbench.corpus.layout import (
    FIELD_TYPES,
    FILE_STEMS,
    OPTIONAL_FIELD_TYPES,
    discover_concepts,
    iter_jsonl,
    link_problem,
    read_manifest,
    schema_problems,
)
from poolbench.corpus.passage import LABEL_NAMES, PLACEMENTS, TIERS
from poolbench.errors import CorpusError

Severity = Literal["error", "warning"]

MIN_DOMAINS = 3
MAX_CLASS_RATIO = 1.5
MIN_HARD_TEST_PAIRS = 8
"""Hard test pairs a concept needs before its hard-tier AUROC gets an interval worth printing (16 passages; below
that a pair bootstrap has too few distinct resamples to cover)."""
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")


@dataclass(frozen=True)
class Finding:
    """One defect: where it is (file relative to the root, 1-based line, field) and what is wrong."""

    severity: Severity
    file: str
    line: int | None
    field: str | None
    message: str

    def __str__(self) -> str:
        where = self.file + (f":{self.line}" if self.line is not None else "")
        return f"{self.severity}: {where}: {self.field or '-'}: {self.message}"


@dataclass(frozen=True)
class _Row:
    """A schema-valid record and where it came from."""

    file: str
    line: int
    stem: str
    record: dict[str, Any]


def normalise_text(text: str) -> str:
    """Lowercase, whitespace-collapsed text: the identity used for duplicate detection."""
    return re.sub(r"\s+", " ", text).strip().lower()


def text_digest(text: str) -> str:
    """MD5 of the normalised text (a fingerprint, not a security hash)."""
    return hashlib.md5(normalise_text(text).encode()).hexdigest()


def _count_tokens(tokenizer: Any, text: str) -> int:
    """Token count of an HF tokenizer without special tokens, matching what the extractor pools."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _read_rows(root: Path, concept: str, findings: list[Finding], lines: Counter) -> list[_Row]:
    """Parse a concept's files into schema-valid rows; missing files, bad JSON and schema problems
    become findings, and `lines` counts every record line per file so balance ignores broken records."""
    rows: list[_Row] = []
    for stem in FILE_STEMS:
        rel = f"{concept}/{stem}.jsonl"
        path = root / rel
        if not path.is_file():
            findings.append(Finding("error", rel, None, None, link_problem(path) or "missing file"))
            continue
        for line_no, record, error in iter_jsonl(path):
            lines[stem] += 1
            if error is not None:
                findings.append(Finding("error", rel, line_no, None, error))
                continue
            problems = schema_problems(record)
            for name, message in problems:
                findings.append(Finding("error", rel, line_no, name, message))
            if problems:
                continue
            assert isinstance(record, dict)
            for extra in sorted(set(record) - set(FIELD_TYPES) - set(OPTIONAL_FIELD_TYPES)):
                findings.append(Finding("warning", rel, line_no, extra, "unknown field is ignored"))
            rows.append(_Row(rel, line_no, stem, record))
    return rows


def _check_records(rows: list[_Row], findings: list[Finding], tokenizer: Any, max_tokens: int | None) -> None:
    """Per-record rules: label/split vs file name, empty text, token counts."""
    for row in rows:
        r = row.record
        split, label_name = row.stem.split("_")
        if LABEL_NAMES.get(r["label"]) != label_name:
            findings.append(Finding("error", row.file, row.line, "label",
                                    f"label {r['label']} in a {label_name} file"))
        if r["split"] != split:
            findings.append(Finding("error", row.file, row.line, "split",
                                    f"split {r['split']!r} in a {split} file"))
        if not r["text"].strip():
            findings.append(Finding("error", row.file, row.line, "text", "empty text"))
            continue
        if r["token_count"] < 0:
            findings.append(Finding("error", row.file, row.line, "token_count", "negative token_count"))
        n_tokens = r["token_count"]
        if tokenizer is not None:
            n_tokens = _count_tokens(tokenizer, r["text"])
            if n_tokens != r["token_count"]:
                message = f"token_count {r['token_count']} but the tokenizer counts {n_tokens}"
                findings.append(Finding("warning", row.file, row.line, "token_count", message))
        if max_tokens is not None and n_tokens > max_tokens:
            findings.append(Finding("error", row.file, row.line, "text",
                                    f"{n_tokens} tokens exceeds max_tokens {max_tokens}"))


def _check_signal_fields(rows: list[_Row], findings: list[Finding]) -> None:
    """Spans inside the text, sorted and disjoint; their count is the density; a known placement."""
    for row in rows:
        r = row.record
        spans, density, placement = r.get("signal_spans"), r.get("density"), r.get("placement")
        if spans is not None:
            ends = [0, *(v for span in spans for v in span)]
            broken = any(a > b for a, b in pairwise(ends)) or any(a == b for a, b in spans)
            if broken or ends[-1] > len(r["text"]):
                findings.append(Finding("error", row.file, row.line, "signal_spans",
                                        f"spans {spans!r:.60} are not sorted, disjoint, non-empty and inside the "
                                        f"text ({len(r['text'])} characters)"))
            elif density is not None and len(spans) != density:
                findings.append(Finding("error", row.file, row.line, "density",
                                        f"density {density} but {len(spans)} signal span(s)"))
        if density is not None and density < 1:
            findings.append(Finding("error", row.file, row.line, "density", f"density {density} is below 1"))
        if placement is not None and placement not in PLACEMENTS:
            findings.append(Finding("error", row.file, row.line, "placement",
                                    f"placement {placement!r} is not one of {', '.join(PLACEMENTS)}"))


def _outside_spans(record: dict) -> str:
    """The text with its signal spans cut out: what a matched pair must share."""
    text, kept, at = record["text"], [], 0
    for start, end in record.get("signal_spans") or ():
        kept.append(text[at:start])
        at = end
    return "\u2026".join([*kept, text[at:]])


def _check_duplicates(rows: list[_Row], findings: list[Finding], seen_ids: dict[str, str]) -> None:
    """Duplicate ids (corpus-wide); duplicate texts in a class (warning) or across labels/splits (error)."""
    first_text: dict[str, _Row] = {}
    for row in rows:
        where = f"{row.file}:{row.line}"
        rid = row.record["id"]
        if rid in seen_ids:
            message = f"duplicate id {rid!r} (first at {seen_ids[rid]})"
            findings.append(Finding("error", row.file, row.line, "id", message))
        else:
            seen_ids[rid] = where
        digest = text_digest(row.record["text"])
        if not row.record["text"].strip():
            continue
        first = first_text.get(digest)
        if first is None:
            first_text[digest] = row
            continue
        f_split, f_label = first.stem.split("_")
        split, label = row.stem.split("_")
        if f_split != split:
            findings.append(Finding("error", row.file, row.line, "text",
                                    f"text duplicates {first.file}:{first.line} across train/test (leakage)"))
        elif f_label != label:
            findings.append(Finding("error", row.file, row.line, "text",
                                    f"text duplicates {first.file}:{first.line} with the opposite label"))
        else:
            findings.append(Finding("warning", row.file, row.line, "text",
                                    f"text duplicates {first.file}:{first.line} within its class"))


def _check_pairs(rows: list[_Row], findings: list[Finding]) -> None:
    """A matched pair is exactly one positive and one negative of the same split."""
    members: dict[str, list[_Row]] = defaultdict(list)
    for row in rows:
        pair_id = row.record["matched_pair_id"]
        if pair_id is not None:
            members[pair_id].append(row)
    for pair_id, rows_of_pair in members.items():
        first = rows_of_pair[0]
        at = f"{first.file}:{first.line}"
        if len(rows_of_pair) == 1:
            findings.append(Finding("error", first.file, first.line, "matched_pair_id",
                                    f"pair {pair_id!r} has only one member"))
            continue
        for extra in rows_of_pair[2:]:
            findings.append(Finding("error", extra.file, extra.line, "matched_pair_id",
                                    f"pair {pair_id!r} has more than two members (first at {at})"))
        second = rows_of_pair[1]
        if second.record["split"] != first.record["split"]:
            findings.append(Finding("error", second.file, second.line, "matched_pair_id",
                                    f"pair {pair_id!r} straddles splits (partner at {at})"))
        if second.record["label"] == first.record["label"]:
            findings.append(Finding("error", second.file, second.line, "matched_pair_id",
                                    f"pair {pair_id!r} members share a label (partner at {at})"))
        for name in OPTIONAL_FIELD_TYPES:
            if second.record.get(name) is None or first.record.get(name) is None:
                if (second.record.get(name) is None) != (first.record.get(name) is None):
                    findings.append(Finding("error", second.file, second.line, name,
                                            f"pair {pair_id!r}: one member has {name} and the other not ({at})"))
            elif name != "signal_spans" and second.record[name] != first.record[name]:
                findings.append(Finding("error", second.file, second.line, name,
                                        f"pair {pair_id!r}: {name} {second.record[name]!r} but the partner at "
                                        f"{at} has {first.record[name]!r}"))
        if first.record.get("signal_spans") and second.record.get("signal_spans") \
                and _outside_spans(first.record) != _outside_spans(second.record):
            findings.append(Finding("error", second.file, second.line, "signal_spans",
                                    f"pair {pair_id!r}: the text outside the signal spans differs from the "
                                    f"partner's at {at}, so the rewrite is not controlled"))


def _check_tiers(concept: str, rows: list[_Row], findings: list[Finding]) -> None:
    """One line per concept: tier values outside TIERS, or too few hard test pairs for a hard-tier interval."""
    unknown = [row for row in rows if row.record.get("tier") is not None and row.record["tier"] not in TIERS]
    if unknown:
        values = sorted({row.record["tier"] for row in unknown})
        first = unknown[0]
        findings.append(Finding("error", concept, None, "tier",
                                f"{len(unknown)} record(s) with tier {', '.join(map(repr, values))} "
                                f"(first at {first.file}:{first.line}); allowed: {', '.join(TIERS)}"))
    hard = Counter(row.stem for row in rows if row.record.get("tier") == "hard")
    if hard:
        n_pairs = min(hard["test_pos"], hard["test_neg"])
        if n_pairs < MIN_HARD_TEST_PAIRS:
            findings.append(Finding("error", concept, None, "tier",
                                    f"{n_pairs} hard test pair(s) ({hard['test_pos']} positive, "
                                    f"{hard['test_neg']} negative); a hard-tier interval needs >= "
                                    f"{MIN_HARD_TEST_PAIRS} (mark them standard or add more)"))


def signal_sentences(record: dict) -> set[str]:
    """The normalised sentences a record carries its concept in: its signal spans where it marks them, else every
    sentence of its text."""
    spans = record.get("signal_spans")
    parts = [record["text"][a:b] for a, b in spans] if spans else [record["text"]]
    return {normalise_text(s) for part in parts for s in _SENTENCE_END.split(part) if s.strip()}


def split_overlap(rows: Iterable[dict]) -> tuple[int, int, int]:
    """(test records sharing a sentence verbatim with train, test records, distinct shared sentences)."""
    rows = list(rows)
    train = set().union(*(signal_sentences(r) for r in rows if r["split"] == "train"))
    test = [signal_sentences(r) for r in rows if r["split"] == "test"]
    shared = set().union(*(s & train for s in test))
    return sum(bool(s & train) for s in test), len(test), len(shared)


def _check_overlap(concept: str, rows: list[_Row], findings: list[Finding], held_out: bool) -> None:
    """Test passages that repeat a train sentence verbatim: an error where the generator promises held-out splits
    (the embedded corpus), a warning with counts for any other corpus."""
    n_shared, n_test, n_sentences = split_overlap(row.record for row in rows)
    if n_shared:
        what = "signal sentence" if any(row.record.get("signal_spans") for row in rows) else "sentence"
        findings.append(Finding("error" if held_out else "warning", concept, None, "text",
                                f"{n_shared} of {n_test} test passages share a {what} verbatim with "
                                f"train ({n_sentences} distinct); the test split is not fully held out"))


def _check_concept_level(concept: str, rows: list[_Row], lines: Counter, findings: list[Finding]) -> None:
    """Domain coverage and class balance, which only make sense over a whole concept."""
    domains = sorted({row.record["domain"] for row in rows})
    if rows and len(domains) < MIN_DOMAINS:
        findings.append(Finding("error", concept, None, "domain",
                                f"{len(domains)} domain(s) ({', '.join(domains)}); need >= {MIN_DOMAINS}"))
    for split in ("train", "test"):
        n_pos, n_neg = lines[f"{split}_pos"], lines[f"{split}_neg"]
        if n_pos == 0 or n_neg == 0:
            findings.append(Finding("error", concept, None, "label",
                                    f"{split} has {n_pos} positives and {n_neg} negatives"))
        elif max(n_pos, n_neg) / min(n_pos, n_neg) > MAX_CLASS_RATIO:
            findings.append(Finding("warning", concept, None, "label",
                                    f"{split} class ratio {n_pos}:{n_neg} exceeds {MAX_CLASS_RATIO}"))


def validate_corpus(root: Path | str, tokenizer: Any = None, max_tokens: int | None = None) -> list[Finding]:
    """Every finding for every concept under `root`; the caller exits non-zero when any is an error."""
    root = Path(root)
    try:
        concepts = discover_concepts(root)
    except CorpusError as exc:
        return [Finding("error", str(root), None, None, str(exc))]
    if not concepts:
        return [Finding("error", str(root), None, None, "no concept folders")]
    findings: list[Finding] = []
    seen_ids: dict[str, str] = {}
    try:
        held_out = bool(read_manifest(root).get("held_out"))
    except CorpusError as exc:
        return [Finding("error", str(root), None, None, str(exc))]
    for concept in concepts:
        lines: Counter = Counter()
        rows = _read_rows(root, concept, findings, lines)
        _check_records(rows, findings, tokenizer, max_tokens)
        _check_signal_fields(rows, findings)
        _check_duplicates(rows, findings, seen_ids)
        _check_pairs(rows, findings)
        _check_tiers(concept, rows, findings)
        _check_overlap(concept, rows, findings, held_out)
        _check_concept_level(concept, rows, lines, findings)
    return findings


@dataclass(frozen=True)
class ConceptProfile:
    """What a reader checks at a glance: passages, token-length range, density, placement and tier histograms."""

    concept: str
    n_passages: int
    token_min: int
    token_max: int
    density: dict[int, int]
    placement: dict[str, int]
    tier: dict[str, int] = field(default_factory=dict)


def profile_corpus(root: Path | str) -> list[ConceptProfile]:
    """Per concept, from the schema-valid records (invalid ones are the findings' business)."""
    root = Path(root)
    try:
        concepts = discover_concepts(root)
    except CorpusError:
        return []
    profiles = []
    for concept in concepts:
        rows = _read_rows(root, concept, [], Counter())
        if not rows:
            continue
        tokens = [row.record["token_count"] for row in rows]
        density = Counter(row.record["density"] for row in rows if row.record.get("density") is not None)
        placement = Counter(row.record["placement"] for row in rows if row.record.get("placement") is not None)
        tier = Counter(str(row.record["tier"]) for row in rows if row.record.get("tier") is not None)
        profiles.append(ConceptProfile(concept, len(rows), min(tokens), max(tokens), dict(sorted(density.items())),
                                       {p: placement[p] for p in sorted(placement, key=_placement_order)},
                                       {t: tier[t] for t in sorted(tier, key=_tier_order)}))
    return profiles


def _tier_order(name: str) -> tuple[int, str]:
    return (TIERS.index(name) if name in TIERS else len(TIERS), name)


def _placement_order(name: str) -> tuple[int, str]:
    return (PLACEMENTS.index(name) if name in PLACEMENTS else len(PLACEMENTS), name)


def render_profile(profiles: list[ConceptProfile]) -> Table:
    """Per concept: passages, token_count range, density, placement and tier histograms (`-` when not recorded)."""
    table = Table(title="Corpus profile (token_count range; passages per density, placement and tier)")
    for column in ("concept", "passages", "tokens", "density", "placement", "tier"):
        table.add_column(column, overflow="fold")
    for p in profiles:
        density = " ".join(f"{k}:{v}" for k, v in p.density.items()) or "-"
        placement = " ".join(f"{k}:{v}" for k, v in p.placement.items()) or "-"
        tier = " ".join(f"{k}:{v}" for k, v in p.tier.items()) or "-"
        table.add_row(p.concept, str(p.n_passages), f"{p.token_min}-{p.token_max}", density, placement, tier)
    return table


def has_errors(findings: Iterable[Finding]) -> bool:
    """Whether any finding is a hard error (the CLI then exits 1)."""
    return any(f.severity == "error" for f in findings)


def summarize_findings(findings: list[Finding]) -> str:
    """One line for the end of a validation run."""
    n_err = sum(f.severity == "error" for f in findings)
    n_warn = len(findings) - n_err
    files = len({f.file for f in findings})
    if not findings:
        return "corpus OK: no findings"
    return f"{n_err} error(s), {n_warn} warning(s) in {files} file(s)"


def render_findings(findings: list[Finding]) -> Table:
    """A rich table of findings, errors first, for the CLI."""
    table = Table(title="Corpus validation", caption=summarize_findings(findings))
    for column in ("severity", "file", "line", "field", "message"):
        table.add_column(column, overflow="fold")
    order = sorted(findings, key=lambda f: (f.severity != "error", f.file, f.line or 0))
    for f in order:
        style = "red" if f.severity == "error" else "yellow"
        table.add_row(f.severity, f.file, "" if f.line is None else str(f.line), f.field or "", f.message,
                      style=style)
    return table
