"""The corpus loader: strict types, one-line errors naming file:line, stable content hashes, atomic writes.

The JSONL fixture helpers here are shared with test_corpus_validation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poolbench.corpus.layout import load_corpus, write_corpus
from poolbench.corpus.passage import Passage
from poolbench.errors import CorpusError


def record(concept: str, stem: str, i: int, text: str, domain: str, pair: str | None = None) -> dict:
    split, kind = stem.split("_")
    return {"id": f"{concept}-{split}-{kind}-{i:05d}", "text": text, "label": 1 if kind == "pos" else 0,
            "domain": domain, "token_count": len(text.split()), "matched_pair_id": pair, "split": split}


def valid_concept(concept: str = "alpha") -> dict[str, list[dict]]:
    """3 + 3 train and 2 + 2 test records over three domains; train 0 and test 0 are matched pairs."""
    pair0, pair1 = f"{concept}-pair-00000", f"{concept}-pair-00001"
    return {
        "train_pos": [record(concept, "train_pos", 0, "The drug may reduce pain.", "science", pair0),
                      record(concept, "train_pos", 1, "Perhaps the merger lifts sales.", "news"),
                      record(concept, "train_pos", 2, "It seems the bus is late again.", "email")],
        "train_neg": [record(concept, "train_neg", 0, "The drug reduces pain.", "science", pair0),
                      record(concept, "train_neg", 1, "The merger lifts sales.", "news"),
                      record(concept, "train_neg", 2, "The bus is late again.", "email")],
        "test_pos": [record(concept, "test_pos", 0, "The coating might slow rust.", "science", pair1),
                     record(concept, "test_pos", 1, "Arguably the tax cut helps.", "news")],
        "test_neg": [record(concept, "test_neg", 0, "The coating slows rust.", "science", pair1),
                     record(concept, "test_neg", 1, "The tax cut helps.", "news")],
    }


def write_concept(root: Path, records: dict[str, list], concept: str = "alpha") -> Path:
    """Write records (dicts, or raw strings for broken lines) one per line; returns the concept folder."""
    folder = root / concept
    folder.mkdir(parents=True, exist_ok=True)
    for stem, rows in records.items():
        lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
        (folder / f"{stem}.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return folder


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Two valid concepts under tmp_path/corpus (so other folders in tmp_path are not concepts)."""
    write_concept(tmp_path / "corpus", valid_concept("beta"), "beta")
    write_concept(tmp_path / "corpus", valid_concept("alpha"), "alpha")
    return tmp_path / "corpus"


def test_load_orders_concepts_and_passages(root: Path) -> None:
    corpus = load_corpus(root)
    assert corpus.root == root
    assert corpus.concepts == ["alpha", "beta"]
    ids = [p.id for p in corpus.passages("alpha")]
    assert ids == ["alpha-train-pos-00000", "alpha-train-pos-00001", "alpha-train-pos-00002",
                   "alpha-train-neg-00000", "alpha-train-neg-00001", "alpha-train-neg-00002",
                   "alpha-test-pos-00000", "alpha-test-pos-00001",
                   "alpha-test-neg-00000", "alpha-test-neg-00001"]
    test = corpus.passages("alpha", split="test")
    assert [p.id for p in test] == ids[6:]
    first = corpus.passages("alpha")[0]
    assert first == Passage(id="alpha-train-pos-00000", text="The drug may reduce pain.", label=1,
                            domain="science", token_count=5, matched_pair_id="alpha-pair-00000",
                            split="train", concept="alpha")


def test_load_subset_and_unknown_concept(root: Path) -> None:
    assert load_corpus(root, ["beta"]).concepts == ["beta"]
    with pytest.raises(CorpusError) as err:
        load_corpus(root, ["gamma"])
    assert str(err.value) == f"unknown concept 'gamma' in {root} (known: alpha, beta)"
    corpus = load_corpus(root, ["alpha"])
    with pytest.raises(CorpusError, match=r"^unknown concept 'beta' in .* \(known: alpha\)$"):
        corpus.passages("beta")
    with pytest.raises(CorpusError, match="unknown split 'dev'"):
        corpus.passages("alpha", split="dev")


def test_bad_json_names_file_and_line(root: Path) -> None:
    records = valid_concept()
    records["train_neg"][2] = '{"id": "alpha-train-neg-00002", "text": '
    write_concept(root, records)
    with pytest.raises(CorpusError) as err:
        load_corpus(root, ["alpha"])
    message = str(err.value)
    assert message.startswith(f"{root / 'alpha' / 'train_neg.jsonl'}:3: invalid JSON")
    assert "\n" not in message


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("domain", None, "field domain: missing field"),
        ("label", "1", "field label: expected int, got str '1'"),
        ("label", True, "field label: expected int, got bool True"),
        ("token_count", 3.0, "field token_count: expected int, got float 3.0"),
        ("matched_pair_id", 7, "field matched_pair_id: expected str or null, got int 7"),
    ],
)
def test_missing_or_mistyped_field(root: Path, field: str, value: object, expected: str) -> None:
    records = valid_concept()
    if value is None:
        del records["test_pos"][1][field]
    else:
        records["test_pos"][1][field] = value
    write_concept(root, records)
    with pytest.raises(CorpusError) as err:
        load_corpus(root)
    assert str(err.value) == f"{root / 'alpha' / 'test_pos.jsonl'}:2: {expected}"


def test_missing_file_and_root(root: Path, tmp_path: Path) -> None:
    (root / "alpha" / "test_neg.jsonl").unlink()
    with pytest.raises(CorpusError, match=r"test_neg\.jsonl: missing file$"):
        load_corpus(root)
    with pytest.raises(CorpusError, match="is not a directory"):
        load_corpus(tmp_path / "nowhere")


def test_concept_hash_ignores_formatting_and_location(root: Path, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    folder = write_concept(other, valid_concept())
    # Same records, different key order and spacing.
    for stem, rows in valid_concept().items():
        lines = [json.dumps(dict(reversed(list(r.items()))), separators=(" , ", " : ")) for r in rows]
        (folder / f"{stem}.jsonl").write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    a, b = load_corpus(root), load_corpus(other)
    assert a.concept_hash("alpha") == b.concept_hash("alpha")
    assert len(a.concept_hash("alpha")) == 64
    assert a.concept_hash("alpha") != a.concept_hash("beta")  # the concept name is part of its identity
    assert load_corpus(root).hash == a.hash


def test_concept_hash_changes_with_content(root: Path) -> None:
    before = load_corpus(root)
    records = valid_concept()
    records["test_neg"][1]["text"] = "The tax cut helps a lot."
    write_concept(root, records)
    after = load_corpus(root)
    assert after.concept_hash("alpha") != before.concept_hash("alpha")
    assert after.concept_hash("beta") == before.concept_hash("beta")
    assert after.hash != before.hash
    assert load_corpus(root, ["beta"]).hash != after.hash


def test_write_corpus_round_trip_and_replace(tmp_path: Path, root: Path) -> None:
    passages = load_corpus(root).passages("alpha")
    out = tmp_path / "out"
    write_corpus(out, {"alpha": passages})
    assert load_corpus(out).passages("alpha") == passages
    assert load_corpus(out).concept_hash("alpha") == load_corpus(root).concept_hash("alpha")
    write_corpus(out, {"alpha": passages[:3] + passages[6:7]})
    assert [p.id for p in load_corpus(out).passages("alpha")] == [p.id for p in passages[:3] + passages[6:7]]
    assert sorted(p.name for p in out.iterdir()) == ["alpha"]  # no temp folders left behind
    assert (out / "alpha" / "train_neg.jsonl").read_text() == ""


def test_write_corpus_rejects_misfiled_passage(tmp_path: Path, root: Path) -> None:
    passages = load_corpus(root).passages("alpha")
    with pytest.raises(CorpusError, match="concept 'alpha' filed under 'beta'"):
        write_corpus(tmp_path / "out", {"beta": passages})
    assert not (tmp_path / "out" / "beta").exists()


def with_signal(records: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The fixture's matched pairs marked as corpus v2 marks them: the whole text is one signal span."""
    for rows in records.values():
        for r in rows:
            if r["matched_pair_id"] is not None:
                r.update(signal_spans=[[0, len(r["text"])]], density=1, placement="start")
    return records


def test_optional_signal_fields_are_kept_and_hashed(root: Path) -> None:
    before = load_corpus(root).concept_hash("alpha")
    write_concept(root, with_signal(valid_concept()))
    corpus = load_corpus(root)
    first = corpus.passages("alpha")[0]
    assert (first.signal_spans, first.density, first.placement) == (((0, 25),), 1, "start")
    assert first.to_record()["signal_spans"] == [[0, 25]]
    unmarked = corpus.passages("alpha")[1]
    assert (unmarked.signal_spans, unmarked.density, unmarked.placement) == (None, None, None)
    assert "density" not in unmarked.to_record()  # a record without the fields writes exactly the v1 keys
    assert corpus.concept_hash("alpha") != before  # the marks are part of the data
    write_concept(root, valid_concept())
    assert load_corpus(root).concept_hash("alpha") == before  # and absent marks leave the v1 hash unchanged


@pytest.mark.parametrize(("value", "expected"), [
    ([[0, "5"]], "field signal_spans: expected a list of [start, end] integer pairs, got [[0, '5']]"),
    ([[0, 5, 7]], "field signal_spans: expected a list of [start, end] integer pairs, got [[0, 5, 7]]"),
    ("0-5", "field signal_spans: expected list, got str '0-5'"),
])
def test_mistyped_signal_spans(root: Path, value: object, expected: str) -> None:
    records = valid_concept()
    records["train_pos"][2]["signal_spans"] = value
    write_concept(root, records)
    with pytest.raises(CorpusError) as err:
        load_corpus(root)
    assert str(err.value) == f"{root / 'alpha' / 'train_pos.jsonl'}:3: {expected}"
