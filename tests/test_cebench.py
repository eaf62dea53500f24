"""CE-Bench: hand-computed contrastive/independent scores, token-span alignment, dataset format and errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from poolbench.cebench.data import (
    CEBenchDataError,
    generate_cebench,
    load_cebench,
    write_cebench,
)
from poolbench.cebench.sae import SAE, SAEError, load_sae, save_sae
from poolbench.cebench.scores import (
    CEBenchError,
    cebench_scores,
    entry_means,
    normalise_jointly,
)
from poolbench.pooler.alignment import marked_token_mask


def _toy():
    """Two entries, two features; stories ordered a0, b0, a1, b1."""
    stories = [np.array([[1.0, 0], [3, 0]]), np.array([[0.0, 2]]),
               np.array([[2.0, 1]]), np.array([[4.0, 0], [0, 0]])]
    marked = [np.array([True, False]), np.array([False]), np.array([False]), np.array([False, True])]
    return entry_means(stories, marked, ["e0", "e1"])


def test_entry_means_by_hand():
    means = _toy()
    np.testing.assert_allclose(means.story_a, [[2, 0], [2, 1]])
    np.testing.assert_allclose(means.story_b, [[0, 2], [2, 0]])
    np.testing.assert_allclose(means.marked, [[1, 0], [0, 0]])
    np.testing.assert_allclose(means.unmarked, [[1.5, 1], [3, 0.5]])


def test_scores_by_hand():
    # contrastive stack per feature: f0 {2,0,2,2} -> /2, f1 {0,2,1,0} -> /2
    # entry0 |a-b| = [1, 1] -> 1; entry1 = [0, 0.5] -> 0.5; mean 0.75
    # independent stack: f0 {1,1.5,0,3} -> /3, f1 {0,1,0,0.5} -> /1
    # entry0 |m-u| = [1/6, 1] -> 1; entry1 = [1, 0.5] -> 1; mean 1
    scores = cebench_scores(_toy(), "dataset_minmax")
    assert scores.contrastive == pytest.approx(0.75)
    assert scores.independent == pytest.approx(1.0)
    assert scores.interpretability == pytest.approx(1.75)
    np.testing.assert_allclose(scores.entry_contrastive, [1, 0.5])
    np.testing.assert_allclose(scores.entry_independent, [1, 1])
    np.testing.assert_allclose(scores.feature_contrastive, [0.5, 0.75])
    np.testing.assert_allclose(scores.feature_independent, [7 / 12, 0.75])
    top = scores.top_features(2)
    assert [t["feature"] for t in top] == [1, 0]
    assert top[0]["interpretability"] == pytest.approx(1.5)
    assert top[1]["interpretability"] == pytest.approx(13 / 12)
    assert list(scores.entry_contrastive_feature) == [0, 1]


def test_normalise_jointly_uses_the_dataset_and_zeroes_constant_features():
    first = np.array([[0.0, 5, 1], [10, 5, 1]])
    second = np.array([[5.0, 5, 1], [2.5, 5, 3]])
    a, b = normalise_jointly(first, second)
    np.testing.assert_allclose(a, [[0, 0, 0], [1, 0, 0]])
    np.testing.assert_allclose(b, [[0.5, 0, 0], [0.25, 0, 1]])
    with pytest.raises(CEBenchError, match="at least 2"):
        normalise_jointly(first[:1], second[:1])


def test_scale_invariance_per_feature():
    means = _toy()
    scaled = type(means)(*(x * [10.0, 0.01] + [3, -7] for x in
                           (means.story_a, means.story_b, means.marked, means.unmarked)))
    assert cebench_scores(scaled, "dataset_minmax").contrastive == pytest.approx(
        cebench_scores(means, "dataset_minmax").contrastive)


def test_marked_token_mask_overlap_and_empty_spans():
    offsets = np.array([[0, 0], [0, 3], [3, 4], [4, 9], [9, 9]])
    assert list(marked_token_mask(offsets, [(4, 9)])) == [False, False, False, True, False]
    assert list(marked_token_mask(offsets, [(2, 5)])) == [False, True, True, True, False]
    assert not marked_token_mask(offsets, [(20, 25)]).any()


def test_entry_without_unmarked_or_marked_tokens_is_named():
    stories = [np.ones((1, 2)), np.ones((1, 2)), np.ones((1, 2)), np.ones((1, 2))]
    with pytest.raises(CEBenchError, match=r"'e1'.*no token overlaps"):
        entry_means(stories, [[True], [False], [False], [False]], ["e0", "e1"])
    with pytest.raises(CEBenchError, match=r"'e0'.*none left unmarked"):
        entry_means(stories, [[True], [True], [True], [False]], ["e0", "e1"])


def test_generator_is_deterministic_and_spans_mark_the_subject(tmp_path: Path):
    entries = generate_cebench(12, seed=3)
    assert entries == generate_cebench(12, seed=3)
    assert entries != generate_cebench(12, seed=4)
    for e in entries:
        assert e.story_a != e.story_b
        for story, spans in ((e.story_a, e.spans_a), (e.story_b, e.spans_b)):
            assert len(spans) >= 2
            assert all(story[s:t].lower() == e.subject.lower() for s, t in spans)
    path = tmp_path / "ce.jsonl"
    write_cebench(path, entries)
    assert load_cebench(path) == entries


def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


GOOD = {"id": "x1", "subject": "the cat", "story_a": "The cat sat.", "story_b": "The cat ran.",
        "spans_a": [[0, 7]], "spans_b": [[0, 7]]}


@pytest.mark.parametrize(("bad", "message"), [
    ("{not json", r":2: invalid JSON"),
    ({k: v for k, v in GOOD.items() if k != "story_b"}, r":2: story_b: missing field"),
    ({**GOOD, "spans_a": [[0, 70]]}, r":2: spans_a\[0\]: span \[0, 70\] is not within"),
    ({**GOOD, "spans_b": []}, r":2: spans_b: expected a non-empty list"),
    ({**GOOD, "spans_b": [[0, "7"]]}, r":2: spans_b\[0\]: expected \[start, end\] integers"),
    ({**GOOD, "subject": ""}, r":2: subject: expected a non-empty string"),
    ({**GOOD, "colour": "red"}, r":2: colour: unknown field"),
    ({**GOOD, "id": "x0"}, r":2: id: 'x0' already used on line 1"),
])
def test_malformed_line_is_one_line_error_with_file_line_and_field(tmp_path: Path, bad, message):
    path = _write(tmp_path / "bad.jsonl", [{**GOOD, "id": "x0"}, bad, {**GOOD, "id": "x2"}])
    with pytest.raises(CEBenchDataError, match=r"bad\.jsonl" + message) as info:
        load_cebench(path)
    assert "\n" not in str(info.value)


def test_too_few_entries_and_missing_file(tmp_path: Path):
    with pytest.raises(CEBenchDataError, match="at least 2"):
        load_cebench(_write(tmp_path / "one.jsonl", [GOOD]))
    with pytest.raises(CEBenchDataError, match="no such CE-Bench file"):
        load_cebench(tmp_path / "missing.jsonl")


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained 2-layer d=32 Llama with the tiny tokenizer recipe: enough to run the CLI paths."""
    import torch
    from transformers import LlamaForCausalLM

    from poolbench.corpus.english import generated_texts
    from poolbench.extractor.tiny_model import DEFAULT_CONFIG, _llama_config, train_tokenizer

    out = tmp_path_factory.mktemp("models") / "random"
    tokenizer = train_tokenizer(generated_texts(300), 512)
    cfg = replace(DEFAULT_CONFIG, hidden_size=32, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=64)
    torch.manual_seed(0)
    LlamaForCausalLM(_llama_config(cfg, tokenizer)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _app():
    import typer

    from poolbench.cli.cebench import bias, cebench, sae_train

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("cebench")(cebench)
    app.command("sae-train")(sae_train)
    app.command("bias")(bias)
    return app


def test_cli_cebench_on_neurons_and_a_trained_sae(random_llama: Path, tmp_path: Path):
    from typer.testing import CliRunner

    runner = CliRunner()
    sae_path = tmp_path / "sae.safetensors"
    result = runner.invoke(_app(), ["sae-train", "--model", str(random_llama), "--layer", "1", "--features", "64",
                                    "--steps", "30", "--tokens", "2000", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert load_sae(sae_path, hidden_size=32).m == 64
    for extra, unit in (([], "neurons"), (["--sae", str(sae_path)], "SAE")):
        m = 64 if extra else 32
        for normalisation in ("entry_zscore", "dataset_minmax"):
            out = tmp_path / f"{unit}-{normalisation}"
            result = runner.invoke(_app(), ["cebench", "--model", str(random_llama), "--layer", "1", "--entries",
                                            "6", "--out", str(out), "--normalisation", normalisation, *extra])
            assert result.exit_code == 0, result.output
            doc = json.loads((out / "results.json").read_text())
            scores = doc["scores"]
            assert doc["config"]["normalisation"] == normalisation
            if normalisation == "dataset_minmax":
                assert scores["interpretability"] == pytest.approx(scores["contrastive"] + scores["independent"])
                assert 0 < scores["contrastive"] <= 1 and 0 < scores["independent"] <= 1
            else:  # the max z-score of m values (sample std) is at most (m - 1) / sqrt(m)
                bound = (m - 1) / np.sqrt(m)
                assert 0 < scores["contrastive"] <= bound and 0 < scores["independent"] <= bound
            assert len(doc["entries"]) == 6 and doc["versions"]["torch"] and doc["config"]["layer"] == 1
            assert len(doc["features"]["contrastive"]) == m
    save_sae(_wrong_width_sae(), tmp_path / "wide.npz")
    result = runner.invoke(_app(), ["cebench", "--model", str(random_llama), "--sae", str(tmp_path / "wide.npz"),
                                    "--entries", "4", "--out", str(tmp_path / "x")])
    assert isinstance(result.exception, SAEError)
    assert "wide.npz: tensor W_enc has shape (16, 8)" in str(result.exception)


def _wrong_width_sae() -> SAE:
    return SAE(W_enc=np.zeros((16, 8), np.float32), b_enc=np.zeros(8, np.float32),
               W_dec=np.zeros((8, 16), np.float32), b_dec=np.zeros(16, np.float32))


def _three_feature_means():
    from poolbench.cebench.scores import CEBenchMeans

    return CEBenchMeans(story_a=np.array([[3.0, 0, 0], [1, 1, 1]]), story_b=np.array([[0.0, 0, 0], [1, 1, 1]]),
                        marked=np.array([[1.0, 1, 0], [0, 2, 0]]), unmarked=np.zeros((2, 3)))


def test_published_entry_zscore_by_hand():
    """CE-Bench's own code: per entry, z-score the distance across features (sample std), score = max z."""
    s = cebench_scores(_three_feature_means())
    assert s.normalisation == "entry_zscore"
    # entry0 |a-b| = [3,0,0] -> z = [2, -1, -1]/sqrt(3); entry1 |a-b| = 0 -> constant -> 0
    np.testing.assert_allclose(s.entry_contrastive, [2 / np.sqrt(3), 0.0])
    # entry0 |m-u| = [1,1,0] -> max z 1/sqrt(3); entry1 [0,2,0] -> 2/sqrt(3)
    np.testing.assert_allclose(s.entry_independent, [1 / np.sqrt(3), 2 / np.sqrt(3)])
    assert s.contrastive == pytest.approx(1 / np.sqrt(3))
    assert s.independent == pytest.approx(np.sqrt(3) / 2)
    # summed distances: entry0 [4,1,0] -> (7/3)/sqrt(78/18); entry1 [0,2,0] -> 2/sqrt(3)
    assert s.interpretability == pytest.approx(((7 / 3) / np.sqrt(78 / 18) + 2 / np.sqrt(3)) / 2)
    np.testing.assert_allclose(s.feature_contrastive, [1 / np.sqrt(3), -1 / (2 * np.sqrt(3)), -1 / (2 * np.sqrt(3))])


def test_entry_zscore_matches_a_plain_loop_in_torch():
    """The published definition written the obvious way (torch.std is the sample std) gives the same numbers."""
    import torch

    rng = np.random.default_rng(4)
    from poolbench.cebench.scores import CEBenchMeans

    means = CEBenchMeans(*(rng.gamma(1.0, size=(9, 17)) for _ in range(4)))
    means.marked[3] = means.unmarked[3]  # a constant distance vector
    ours = cebench_scores(means)
    for e in range(9):
        d = torch.abs(torch.tensor(means.story_a[e]) - torch.tensor(means.story_b[e]))
        z = d - d.mean()
        z = z / (torch.std(z) if torch.std(z) != 0 else 1)
        assert ours.entry_contrastive[e] == pytest.approx(float(z.max()), abs=1e-12)
        d2 = torch.abs(torch.tensor(means.marked[e]) - torch.tensor(means.unmarked[e]))
        z2 = d2 - d2.mean()
        z2 = z2 / (torch.std(z2) if torch.std(z2) != 0 else 1)
        assert ours.entry_independent[e] == pytest.approx(float(z2.max()), abs=1e-12)


def test_unknown_normalisation_is_one_line():
    with pytest.raises(CEBenchError, match="normalisation must be one of entry_zscore, dataset_minmax, got 'l2'"):
        cebench_scores(_three_feature_means(), "l2")
