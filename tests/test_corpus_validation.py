"""Every validator rule on a hand-written fixture: each asserts the exact severity, file, line and field."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from test_corpus import record, valid_concept, with_signal, write_concept

from poolbench.corpus.validation import (
    Finding,
    has_errors,
    profile_corpus,
    render_findings,
    render_profile,
    summarize_findings,
    text_digest,
    validate_corpus,
)


def where(f: Finding) -> tuple[str, str, int | None, str | None]:
    return f.severity, f.file, f.line, f.field


def run(tmp_path: Path, records: dict, **kwargs) -> list[tuple[str, str, int | None, str | None]]:
    root = tmp_path / "corpus"
    write_concept(root, records)
    return [where(f) for f in validate_corpus(root, **kwargs)]


def test_valid_fixture_has_no_findings(tmp_path: Path) -> None:
    assert run(tmp_path, valid_concept()) == []


def test_missing_root_and_empty_root(tmp_path: Path) -> None:
    [finding] = validate_corpus(tmp_path / "nowhere")
    assert (finding.severity, finding.line) == ("error", None)
    assert "is not a directory" in finding.message
    assert [f.message for f in validate_corpus(tmp_path)] == ["no concept folders"]


def test_missing_file(tmp_path: Path) -> None:
    records = valid_concept()
    root = tmp_path / "corpus"
    write_concept(root, records)
    (root / "alpha" / "test_neg.jsonl").unlink()
    findings = validate_corpus(root)
    assert ("error", "alpha/test_neg.jsonl", None, None) in [where(f) for f in findings]
    # The test pairs have lost their negatives, and the test split has no negatives at all.
    assert ("error", "alpha/test_pos.jsonl", 1, "matched_pair_id") in [
        (f.severity, f.file, f.line, f.field) for f in findings]
    assert ("error", "alpha", None, "label") in [where(f) for f in findings]


def test_bad_json(tmp_path: Path) -> None:
    records = valid_concept()
    records["train_neg"][2] = "{not json"
    assert run(tmp_path, records) == [("error", "alpha/train_neg.jsonl", 3, None)]


def test_missing_mistyped_and_unknown_fields(tmp_path: Path) -> None:
    records = valid_concept()
    del records["train_pos"][1]["domain"]
    records["train_pos"][2]["token_count"] = "7"
    records["test_neg"][1]["label"] = False
    records["test_neg"][0]["source"] = "web"
    assert run(tmp_path, records) == [
        ("error", "alpha/train_pos.jsonl", 2, "domain"),
        ("error", "alpha/train_pos.jsonl", 3, "token_count"),
        ("warning", "alpha/test_neg.jsonl", 1, "source"),
        ("error", "alpha/test_neg.jsonl", 2, "label"),
    ]


def test_non_object_record(tmp_path: Path) -> None:
    records = valid_concept()
    records["train_neg"][1] = "[1, 2]"
    findings = run(tmp_path, records)
    assert findings == [("error", "alpha/train_neg.jsonl", 2, None)]


def test_label_and_split_must_match_file_name(tmp_path: Path) -> None:
    records = valid_concept()
    records["train_neg"][1]["label"] = 1
    records["test_pos"][1]["split"] = "train"
    assert run(tmp_path, records) == [
        ("error", "alpha/train_neg.jsonl", 2, "label"),
        ("error", "alpha/test_pos.jsonl", 2, "split"),
    ]


def test_duplicate_id_across_concepts(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    write_concept(root, valid_concept("alpha"), "alpha")
    beta = valid_concept("beta")
    beta["test_neg"][1]["id"] = "alpha-train-pos-00001"
    write_concept(root, beta, "beta")
    [finding] = validate_corpus(root)
    assert where(finding) == ("error", "beta/test_neg.jsonl", 2, "id")
    assert finding.message == "duplicate id 'alpha-train-pos-00001' (first at alpha/train_pos.jsonl:2)"


def test_text_digest_normalises_case_and_whitespace() -> None:
    assert text_digest("The  Tax cut\thelps.\n") == text_digest("the tax cut helps.")
    # `printf 'the tax cut helps.' | md5sum`
    assert text_digest("the tax cut helps.") == "12ee0f635f66728205aaad6934a9dd7c"
    assert text_digest("the tax cut helps") != text_digest("the tax cut helps.")


def test_duplicate_text_within_class_is_a_warning(tmp_path: Path) -> None:
    records = valid_concept()
    records["train_pos"][2]["text"] = "  perhaps THE merger lifts   sales."
    assert run(tmp_path, records) == [("warning", "alpha/train_pos.jsonl", 3, "text")]


def test_duplicate_text_across_classes_is_an_error(tmp_path: Path) -> None:
    records = valid_concept()
    records["train_neg"][2]["text"] = "It seems the bus is late again."
    root = tmp_path / "corpus"
    write_concept(root, records)
    [finding] = validate_corpus(root)
    assert where(finding) == ("error", "alpha/train_neg.jsonl", 3, "text")
    assert "opposite label" in finding.message and "alpha/train_pos.jsonl:3" in finding.message


def test_duplicate_text_across_splits_is_leakage(tmp_path: Path) -> None:
    records = valid_concept()
    records["test_neg"][1]["text"] = "The merger lifts sales."
    root = tmp_path / "corpus"
    write_concept(root, records)
    finding, overlap = validate_corpus(root)
    assert where(finding) == ("error", "alpha/test_neg.jsonl", 2, "text")
    assert "leakage" in finding.message and "alpha/train_neg.jsonl:2" in finding.message
    # the same text is also a sentence shared between the splits: a warning with counts (no manifest)
    assert where(overlap) == ("warning", "alpha", None, "text")
    assert overlap.message.startswith("1 of 4 test passages share a sentence verbatim with train (1 distinct)")


def test_pair_with_one_member(tmp_path: Path) -> None:
    records = valid_concept()
    records["train_neg"][0]["matched_pair_id"] = None
    assert run(tmp_path, records) == [("error", "alpha/train_pos.jsonl", 1, "matched_pair_id")]


def test_pair_with_three_members(tmp_path: Path) -> None:
    records = valid_concept()
    records["train_neg"][1]["matched_pair_id"] = "alpha-pair-00000"
    assert run(tmp_path, records) == [("error", "alpha/train_neg.jsonl", 2, "matched_pair_id")]


def test_pair_across_splits(tmp_path: Path) -> None:
    records = valid_concept()
    records["test_neg"][0]["matched_pair_id"] = "alpha-pair-00000"
    records["train_neg"][0]["matched_pair_id"] = "alpha-pair-00001"
    findings = validate_corpus(_write(tmp_path, records))
    assert [where(f) for f in findings] == [
        ("error", "alpha/test_neg.jsonl", 1, "matched_pair_id"),
        ("error", "alpha/test_pos.jsonl", 1, "matched_pair_id"),
    ]
    assert "straddles splits (partner at alpha/train_pos.jsonl:1)" in findings[0].message


def test_pair_with_same_labels(tmp_path: Path) -> None:
    records = valid_concept()
    records["train_neg"][0]["matched_pair_id"] = None
    records["train_pos"][1]["matched_pair_id"] = "alpha-pair-00000"
    assert run(tmp_path, records) == [("error", "alpha/train_pos.jsonl", 2, "matched_pair_id")]


def test_too_few_domains(tmp_path: Path) -> None:
    records = valid_concept()
    for rows in records.values():
        for r in rows:
            if r["domain"] == "email":
                r["domain"] = "news"
    findings = validate_corpus(_write(tmp_path, records))
    assert [where(f) for f in findings] == [("error", "alpha", None, "domain")]
    assert findings[0].message == "2 domain(s) (news, science); need >= 3"


def test_class_imbalance_is_a_warning(tmp_path: Path) -> None:
    records = valid_concept()
    records["train_pos"].append(record("alpha", "train_pos", 3, "The coating may well help.", "science"))
    records["train_pos"].append(record("alpha", "train_pos", 4, "It seems rents may rise.", "news"))
    findings = validate_corpus(_write(tmp_path, records))
    assert [where(f) for f in findings] == [("warning", "alpha", None, "label")]
    assert findings[0].message == "train class ratio 5:3 exceeds 1.5"


def test_empty_class_is_an_error(tmp_path: Path) -> None:
    records = valid_concept()
    records["test_neg"] = []
    records["test_pos"] = [r | {"matched_pair_id": None} for r in records["test_pos"]]
    findings = validate_corpus(_write(tmp_path, records))
    assert [where(f) for f in findings] == [("error", "alpha", None, "label")]
    assert findings[0].message == "test has 2 positives and 0 negatives"


def test_empty_text(tmp_path: Path) -> None:
    records = valid_concept()
    records["test_pos"][1]["text"] = "   "
    assert run(tmp_path, records) == [("error", "alpha/test_pos.jsonl", 2, "text")]


class CharTokenizer:
    """A stand-in HF tokenizer: one token per character, plus a BOS the validator must not count."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [ord(c) for c in text]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def test_token_count_checked_against_tokenizer(tmp_path: Path) -> None:
    records = valid_concept()
    for rows in records.values():
        for r in rows:
            r["token_count"] = len(r["text"])
    records["train_neg"][1]["token_count"] = 4
    root = _write(tmp_path, records)
    assert validate_corpus(root) == []  # without a tokenizer the count is not checked
    [finding] = validate_corpus(root, tokenizer=CharTokenizer())
    assert where(finding) == (
        "warning", "alpha/train_neg.jsonl", 2, "token_count")
    assert finding.message == "token_count 4 but the tokenizer counts 23"


def test_max_tokens(tmp_path: Path) -> None:
    records = valid_concept()
    # Longest texts: train_pos lines 2 and 3, 31 characters each; only line 3 has 7 words.
    assert run(tmp_path, records, max_tokens=6) == [("error", "alpha/train_pos.jsonl", 3, "text")]
    findings = run(tmp_path, records, tokenizer=CharTokenizer(), max_tokens=30)
    assert [f for f in findings if f[0] == "error"] == [("error", "alpha/train_pos.jsonl", 2, "text"),
                                                         ("error", "alpha/train_pos.jsonl", 3, "text")]


def test_render_and_summary() -> None:
    findings = [Finding("warning", "a/train_pos.jsonl", 2, "text", "dup"),
                Finding("error", "a/test_neg.jsonl", 5, "label", "label 1 in a neg file"),
                Finding("error", "a", None, "domain", "too few")]
    assert has_errors(findings) and not has_errors(findings[:1])
    assert summarize_findings(findings) == "2 error(s), 1 warning(s) in 3 file(s)"
    assert summarize_findings([]) == "corpus OK: no findings"
    table = render_findings(findings)
    assert table.row_count == 3
    assert [c.header for c in table.columns] == ["severity", "file", "line", "field", "message"]
    assert list(table.columns[1].cells) == ["a", "a/test_neg.jsonl", "a/train_pos.jsonl"]
    console = Console(width=200, record=True)
    console.print(table)
    assert "label 1 in a neg file" in console.export_text()
    assert str(findings[1]) == "error: a/test_neg.jsonl:5: label: label 1 in a neg file"


def _write(tmp_path: Path, records: dict) -> Path:
    root = tmp_path / "corpus"
    write_concept(root, records)
    return root


@pytest.mark.parametrize("stem", ["train_pos", "test_neg"])
def test_every_bad_record_gets_one_line(tmp_path: Path, stem: str) -> None:
    records = valid_concept()
    records[stem][1]["label"] = 7
    findings = validate_corpus(_write(tmp_path, records))
    assert [(f.file, f.line, f.field) for f in findings] == [(f"alpha/{stem}.jsonl", 2, "label")]
    assert "\n" not in str(findings[0])


def test_signal_fields_of_a_clean_fixture_pass(tmp_path: Path) -> None:
    assert run(tmp_path, with_signal(valid_concept())) == []


def test_bad_signal_spans_density_and_placement(tmp_path: Path) -> None:
    records = with_signal(valid_concept())
    records["train_pos"][0]["signal_spans"] = [[0, 99]]  # past the end of a 25-character text
    records["train_neg"][0]["signal_spans"] = [[4, 9], [0, 3]]  # out of order
    records["test_pos"][0]["density"] = 2  # one span
    records["test_neg"][0]["density"] = 2
    records["test_neg"][0]["signal_spans"] = [[0, 5], [5, 5]]  # an empty span
    records["train_pos"][1].update(placement="top", density=0)
    findings = run(tmp_path, records)
    assert ("error", "alpha/train_pos.jsonl", 1, "signal_spans") in findings
    assert ("error", "alpha/train_neg.jsonl", 1, "signal_spans") in findings
    assert ("error", "alpha/test_pos.jsonl", 1, "density") in findings
    assert ("error", "alpha/test_neg.jsonl", 1, "signal_spans") in findings
    assert ("error", "alpha/train_pos.jsonl", 2, "placement") in findings
    assert ("error", "alpha/train_pos.jsonl", 2, "density") in findings
    assert all(f[0] == "error" for f in findings)
    [message] = [f.message for f in validate_corpus(tmp_path / "corpus")
                 if (f.file, f.line, f.field) == ("alpha/test_pos.jsonl", 1, "density")]
    assert message == "density 2 but 1 signal span(s)"


def test_pair_members_must_share_marks_and_context(tmp_path: Path) -> None:
    records = with_signal(valid_concept())
    records["train_neg"][0]["placement"] = "end"  # its positive says start
    del records["test_neg"][0]["density"]  # its positive has one
    findings = run(tmp_path, records)
    assert ("error", "alpha/train_neg.jsonl", 1, "placement") in findings
    assert ("error", "alpha/test_neg.jsonl", 1, "density") in findings
    # Spans that leave different context outside them: not a controlled rewrite.
    records = with_signal(valid_concept())
    records["train_pos"][0]["signal_spans"] = [[4, 25]]  # "The " stays outside ...
    records["train_neg"][0]["signal_spans"] = [[0, 22]]  # ... but not in the rewrite
    findings = validate_corpus(_write(tmp_path / "b", records))
    assert [(f.file, f.line, f.field) for f in findings] == [("alpha/train_neg.jsonl", 1, "signal_spans")]
    assert "not controlled" in findings[0].message


def test_profile_counts_density_placement_and_token_range(tmp_path: Path) -> None:
    records = with_signal(valid_concept())
    records["test_pos"][0].update(density=1, placement="end")
    records["test_neg"][0].update(density=1, placement="end")
    root = _write(tmp_path, records)
    [profile] = profile_corpus(root)
    # token_count is the word count in the fixture: 4 to 7 words; of the two marked pairs, train 0 sits at the
    # start and test 0 (changed above) at the end; the six unpaired records have no marks.
    assert (profile.concept, profile.n_passages, profile.token_min, profile.token_max) == ("alpha", 10, 4, 7)
    assert profile.density == {1: 4}
    assert profile.placement == {"start": 2, "end": 2}
    console = Console(width=200, record=True)
    console.print(render_profile([profile]))
    text = console.export_text()
    assert "alpha" in text and "4-7" in text and "1:4" in text and "start:2 end:2" in text
