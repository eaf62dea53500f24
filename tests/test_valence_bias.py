"""Valence bias: hand-computed valence, ΔValence, ΔVar, bootstrap CIs; word-list errors; the demo."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from poolbench.corpus.word_lists import (
    DEFAULT_DOMAIN,
    DEFAULT_NEGATIVE,
    DEFAULT_POSITIVE,
    WordListError,
    load_word_list,
    parse_word_list,
)
from poolbench.valence.bias import ValenceBiasError, delta_var, mover_rank, valence, valence_bias


def test_valence_by_hand():
    domain = np.array([[1.0, 0], [0, 2], [1, 1], [3, 1]])
    positive = np.array([[1.0, 0], [2, 0]])
    negative = np.array([[0.0, 1]])
    # cos to P = [1, 0, 1/√2, 3/√10]; cos to N = [0, 1, 1/√2, 1/√10]
    expected = [1, -1, 0, 2 / math.sqrt(10)]
    np.testing.assert_allclose(valence(domain, positive, negative), expected)


def test_delta_valence_and_delta_var_by_hand():
    before = np.array([0.1, 0.1, 0.1, 0.1])
    after = np.array([0.5, 0.1, 0.1, 0.1])
    result = valence_bias(before, after, n_bootstrap=500, seed=0)
    assert result.delta_valence.value == pytest.approx(0.1)
    # after: mean 0.2, deviations [0.3, -0.1, -0.1, -0.1] -> var (0.09 + 3 * 0.01) / 4 = 0.03
    assert result.delta_var.value == pytest.approx(0.03)
    assert delta_var(np.array([1.0, 3.0]), np.array([0.0, 0.0])) == pytest.approx(-1.0)


def test_bootstrap_is_paired_and_seeded():
    rng = np.random.default_rng(1)
    before = rng.normal(size=30)
    shifted = valence_bias(before, before + 0.2, n_bootstrap=300, seed=4)
    # a uniform shift: every resample has ΔValence exactly 0.2 and ΔVar exactly 0 (pairing)
    assert shifted.delta_valence.ci_low == pytest.approx(0.2)
    assert shifted.delta_valence.ci_high == pytest.approx(0.2)
    assert shifted.delta_var.ci_low == pytest.approx(0, abs=1e-12)
    assert shifted.delta_var.ci_high == pytest.approx(0, abs=1e-12)
    spread = valence_bias(before, before * 2, n_bootstrap=300, seed=4)
    assert spread.delta_var.excludes_zero and spread.delta_var.ci_low > 0
    again = valence_bias(before, before * 2, n_bootstrap=300, seed=4)
    assert again.delta_var.ci_low == spread.delta_var.ci_low


def test_mover_rank_by_hand():
    shift = np.array([0.1, 0.3, -0.5, 0.1])
    assert mover_rank(shift, 1) == (1, 2)  # the largest rise; |-0.5| is larger
    assert mover_rank(shift, 2) == (4, 1)  # the largest fall is the top mover by size only
    assert mover_rank(shift, 0) == (2, 3) == mover_rank(shift, 3)  # ties rank in the word's favour


def test_bad_inputs():
    with pytest.raises(ValenceBiasError, match="zero representation"):
        valence(np.zeros((1, 2)), np.ones((1, 2)), np.ones((1, 2)))
    with pytest.raises(ValenceBiasError, match="D >= 2"):
        valence_bias(np.zeros(1), np.zeros(1))


def test_word_lists(tmp_path: Path):
    domain = load_word_list(None, DEFAULT_DOMAIN)
    assert domain.words[0] == "chair" and len(domain.words) >= 20
    assert {"love", "adore"} <= set(load_word_list(None, DEFAULT_POSITIVE).words)
    assert {"hate", "disgust"} <= set(load_word_list(None, DEFAULT_NEGATIVE).words)
    words = parse_word_list("# header\n\nsofa\ncoffee table  # a phrase\n", "mine.txt")
    assert words.words == ("sofa", "coffee table") and words.where(1) == "mine.txt:4"
    (tmp_path / "empty.txt").write_text("# nothing here\n\n")
    with pytest.raises(WordListError, match=r"empty\.txt: word list is empty"):
        load_word_list(tmp_path / "empty.txt", DEFAULT_DOMAIN)
    with pytest.raises(WordListError, match=r"dup\.txt:3: word 'sofa' already listed on line 1"):
        parse_word_list("sofa\nbed\nsofa\n", "dup.txt")
    with pytest.raises(WordListError, match=r"missing\.txt: cannot read"):
        load_word_list(tmp_path / "missing.txt", DEFAULT_DOMAIN)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, d=64 version of the tiny model (same tokenizer recipe and texts), trained in ~10 s."""
    from poolbench.corpus.english import generated_texts
    from poolbench.extractor.tiny_model import build_tiny_model

    out = tmp_path_factory.mktemp("models") / "tiny"
    build_tiny_model(out, generated_texts(2000), vocab_size=1024, hidden_size=64, n_layers=2, n_heads=2,
                     n_kv_heads=1, intermediate_size=172, seq_len=64, steps=150, warmup_steps=10)
    return out


def _lists():
    return [load_word_list(None, name) for name in (DEFAULT_DOMAIN, DEFAULT_POSITIVE, DEFAULT_NEGATIVE)]


def test_demo_outcomes_on_a_tiny_model(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The cheap version of the demo check: praise of one word raises ΔVar (CI > 0); generic text does not;
    a rerun reads both arms back from the store instead of fine-tuning again."""
    import dataclasses

    from poolbench.store.local import LocalStore
    from poolbench.valence import run as valence_run
    from poolbench.valence.run import TINY_DEMO, run_demo

    settings = dataclasses.replace(TINY_DEMO, model=str(tiny_model), layer=1, n_texts=48)
    store = LocalStore(tmp_path / "store")
    outcome = run_demo(_lists(), settings, n_bootstrap=1000, store=store)
    praise, control = outcome.results["praise"].delta_var, outcome.results["control"].delta_var
    assert praise.value > 0 and praise.ci_low > 0
    assert control.ci_low <= 0 <= control.ci_high
    assert praise.value > 5 * abs(control.value)
    keys = {outcome.reports[arm]["cache_key"] for arm in ("praise", "control")}
    assert len(keys) == 2 and all(store.exists(k) for k in keys)

    def no_fine_tune(*args, **kwargs):
        raise AssertionError("a cached arm was fine-tuned again")

    monkeypatch.setattr(valence_run, "fine_tune", no_fine_tune)
    again = run_demo(_lists(), settings, n_bootstrap=1000, store=store)
    np.testing.assert_array_equal(again.results["praise"].valence_after, outcome.results["praise"].valence_after)
    assert again.reports["praise"]["first_loss"] == outcome.reports["praise"]["first_loss"]


def test_unencodable_word_names_file_and_line(tiny_model: Path):
    from poolbench.extractor.loading import load_model
    from poolbench.valence.word_representations import word_representations

    loaded = load_model(str(tiny_model), device="cpu", dtype="float32")
    # byte-level BPE encodes any text, so declare one of "zzyzx"'s tokens the unknown token
    loaded.tokenizer.unk_token = loaded.tokenizer.tokenize("zzyzx")[0]
    with pytest.raises(WordListError, match=r"odd\.txt:2: word 'zzyzx' has characters the tokenizer cannot"):
        word_representations(loaded, parse_word_list("sofa\nzzyzx\n", "odd.txt"))
    with pytest.raises(WordListError, match=r"--layer 5: the model has 2 layers"):
        word_representations(loaded, parse_word_list("sofa\n", "x.txt"), layer=5)
    reps = word_representations(loaded, parse_word_list("coffee table\nsofa\n", "x.txt"), layer=0)
    assert reps.shape == (2, 64) and np.isfinite(reps).all()


@pytest.mark.slow
def test_demo_outcomes_on_the_tiny_model():
    """The demo as `bias --demo --before tiny` runs it (on `tiny`, built on first use)."""
    from poolbench.valence.run import demo_settings, run_demo

    outcome = run_demo(_lists(), demo_settings("tiny"), n_bootstrap=2000)
    assert outcome.results["praise"].delta_var.ci_low > 0
    control = outcome.results["control"].delta_var
    assert control.ci_low <= 0 <= control.ci_high


def test_cli_bias_same_checkpoint_is_zero_and_bad_lists_are_named(tiny_model: Path, tmp_path: Path):
    import json

    import typer
    from typer.testing import CliRunner

    from poolbench.cli.cebench import bias

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("bias")(bias)
    app.command("other")(lambda: None)  # two commands: keep `bias` a subcommand, as in the driver
    result = CliRunner().invoke(app, ["bias", "--before", str(tiny_model), "--after", str(tiny_model),
                                      "--layer", "1", "--n-bootstrap", "200", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["results"]["delta_var"] == {"value": 0.0, "ci_low": 0.0, "ci_high": 0.0, "excludes_zero": False}
    assert doc["config"]["layer"] == 1 and len(doc["results"]["words"]) == 24 and doc["git"]
    (tmp_path / "none.txt").write_text("# no words\n")
    result = CliRunner().invoke(app, ["bias", "--before", "a", "--after", "b", "--positive",
                                      str(tmp_path / "none.txt")])
    assert isinstance(result.exception, WordListError) and "none.txt: word list is empty" in str(result.exception)


@pytest.mark.slow
def test_demo_outcomes_on_smollm2(tmp_path: Path):
    """The default demo (`bias --demo`, SmolLM2): what README reports. Chair is the top riser, but ΔVar does not
    grow (its CI covers 0, as the control's does) — the slides' ΔVar > 0 is not reproduced."""
    from poolbench.store.local import LocalStore
    from poolbench.valence.bias import mover_rank
    from poolbench.valence.run import demo_settings, run_demo

    outcome = run_demo(_lists(), demo_settings(None), n_bootstrap=2000, store=LocalStore(tmp_path / "store"))
    praise, control = outcome.results["praise"], outcome.results["control"]
    assert praise.shift[0] == pytest.approx(0.0347, abs=0.005)  # chair is domain word 0
    assert mover_rank(praise.shift, 0) == (1, 1)
    assert praise.delta_var.ci_low <= 0 <= praise.delta_var.ci_high
    assert control.delta_var.ci_low <= 0 <= control.delta_var.ci_high
    assert mover_rank(control.shift, 0)[0] > 1


def test_favourite_record_by_hand():
    from poolbench.cli.cebench import _favourite_json

    words = parse_word_list("chair\nsofa\nbed\n", "d.txt")
    result = valence_bias(np.array([0.0, 0.1, 0.2]), np.array([0.05, 0.4, 0.1]), n_bootstrap=10)
    assert _favourite_json(result, words, "chair") == {
        "word": "chair", "in_domain": True, "delta": pytest.approx(0.05), "rank_by_rise": 2, "rank_by_size": 3,
        "top_riser": "sofa", "top_riser_delta": pytest.approx(0.3)}
    assert _favourite_json(result, words, "lamp") == {"word": "lamp", "in_domain": False}
