"""D2's fluency guard through the D2 path (measures.reference_nll -> d2_summary / prompted_summary): reference-model
perplexity unconditioned on the prompt, and distinct-2, alike for steering and prompting. Fluent on-concept text
written for the concept passes; the same text word-shuffled, and a repeated token, fail."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from poolbench.corpus.corpus_versions import generate_embedded_corpus
from poolbench.extractor.loading import load_model
from poolbench.steerer.d2 import d2_summary, prompted_summary
from poolbench.steerer.fluency import (
    DEFAULT_FLUENCY_GUARD,
    DEFAULT_MIN_DISTINCT,
    distinct_n,
    distinct_rows,
    passes_guard,
    reference_model_for,
)
from poolbench.steerer.measures import reference_nll
from poolbench.steerer.worker import SteeringWorker

N = 10  # prompts: 5 choose alpha*, 5 report it (3 a half let one odd passage swing the ratio past 2)


def _corpus_texts() -> tuple[list[str], list[str]]:
    """Test-split frustration passages of the embedded corpus: positives are text written for the concept, the
    negatives (calm messages on the same topics) stand in for the unsteered continuations."""
    passages = [p for p in generate_embedded_corpus(size="tiny", seed=0, version=1)["frustration"]
                if p.split == "test"]
    return ([p.text for p in passages if p.label == 1][:N], [p.text for p in passages if p.label == 0][:N])


def _shuffled(texts: list[str]) -> list[str]:
    out = []
    for i, text in enumerate(texts):
        words = text.split()
        random.Random(i).shuffle(words)
        out.append(" ".join(words))
    return out


def _through_d2(loaded, unsteered: list[str], candidate: list[str]) -> tuple[str, bool | None, bool | None]:
    """The candidate texts as the continuations at alpha = 1 (scored on-concept) and as the prompted baseline's,
    the unsteered ones at alpha = 0: (alpha* outcome, steering at alpha = 1 passes, prompting passes)."""
    nll, n_tok = reference_nll(loaded, unsteered + candidate)
    nll, n_tok = nll.reshape(2, N), n_tok.reshape(2, N)
    distinct = distinct_rows(unsteered + candidate).reshape(2, N)
    scores = np.array([[0.1] * N, [0.9] * N])
    relevance = np.full((2, N), 0.5)
    summary = d2_summary([0.0, 1.0], scores, nll, n_tok, relevance, n_bootstrap=0, distinct=distinct)
    report = np.asarray(summary["report_prompts"])
    prompted = prompted_summary(scores[1], nll[1], n_tok[1], relevance[1], scores[0], nll[0], n_tok[0], report,
                                n_bootstrap=0, distinct_p=distinct[1])
    steered = passes_guard(summary["per_alpha"][1]["fluency_ratio"], summary["per_alpha"][1]["distinct_2"])
    assert prompted["prompted_passes_fluency_guard"] == steered  # one guard, the same texts: the same verdict
    return summary["alpha_star_outcome"], steered, prompted["prompted_passes_fluency_guard"]


def test_distinct_2_by_hand():
    # "the cat sat on the mat": bigrams the-cat, cat-sat, sat-on, on-the, the-mat: 5 of 5 distinct
    assert distinct_n("The cat sat on the mat") == 1.0
    # "a b a b a": a-b, b-a, a-b, b-a: 2 distinct of 4
    assert distinct_n("a b a b a") == 0.5
    assert distinct_n("idiot " * 24) == pytest.approx(1 / 23)  # 23 bigrams, all "idiot idiot"
    assert distinct_n("!" * 40) == pytest.approx(1 / 39)  # punctuation marks are words: 39 bigrams "! !"
    assert distinct_n("word") == 0.0  # no bigram, no variety shown


def test_the_guard_by_hand():
    assert passes_guard(DEFAULT_FLUENCY_GUARD, DEFAULT_MIN_DISTINCT) is True  # both at the bound pass
    assert passes_guard(2.01, 1.0) is False and passes_guard(1.0, 0.49) is False
    assert passes_guard(1.0, None) is True and passes_guard(None, 1.0) is None


def test_the_reference_is_the_other_embedded_model():
    assert reference_model_for("embedded", "auto") != "embedded"
    assert reference_model_for("embedded-gemma", "x") == "x"


def test_prompted_summary_reads_reference_perplexity_and_distinct():
    """Reference NLLs 2 and 1 nats per token: ratio e > 2 fails; 1.5 vs 1 nats: ratio e^0.5 = 1.65 passes unless
    its distinct-2 falls under 0.5."""
    report = np.array([1, 2])
    common = dict(n_bootstrap=0)
    out = prompted_summary(np.zeros(3), np.full(3, 2.0), np.full(3, 1), np.zeros(3), np.zeros(3), np.full(3, 1.0),
                           np.full(3, 1), report, distinct_p=np.ones(3), **common)
    assert out["prompted_fluency_ratio"] == pytest.approx(math.e) and out["prompted_passes_fluency_guard"] is False
    ok = prompted_summary(np.zeros(3), np.full(3, 1.5), np.full(3, 1), np.zeros(3), np.zeros(3), np.full(3, 1.0),
                          np.full(3, 1), report, distinct_p=np.array([0.0, 0.9, 0.8]), **common)
    assert ok["prompted_distinct_2"] == pytest.approx(0.85) and ok["prompted_passes_fluency_guard"] is True
    looped = prompted_summary(np.zeros(3), np.full(3, 1.5), np.full(3, 1), np.zeros(3), np.zeros(3),
                              np.full(3, 1.0), np.full(3, 1), report, distinct_p=np.array([1.0, 0.5, 0.4]), **common)
    assert looped["prompted_distinct_2"] == pytest.approx(0.45) and looped["prompted_passes_fluency_guard"] is False


def test_on_concept_text_passes_and_a_repeated_token_fails_through_d2(tiny_llama_dir):
    """With the session's tiny model as the reference (random weights: every text about equally likely, so this
    test checks the path and distinct-2; the slow test below checks perplexity with a real model)."""
    loaded = load_model(str(tiny_llama_dir), dtype="float32", device="cpu")
    on_concept, unsteered = _corpus_texts()
    assert _through_d2(loaded, unsteered, on_concept) == ("chosen", True, True)
    assert _through_d2(loaded, unsteered, ["idiot " * 24] * N) == ("no_alpha_fluent", False, False)


def test_a_reference_loaded_ahead_is_the_one_the_guard_reads_and_a_bad_one_is_reported_by_the_guard(
        tiny_llama_dir, monkeypatch):
    """SteeringWorker.prepare_reference (an early engine's load, driver/early_engines.py) loads what
    reference_nll then reads, with the same NLLs as a load at the guard's first call; a reference that cannot load
    is one line from prepare_reference (nobody waits for it) and raises at the guard's own call."""
    import poolbench.steerer.worker as worker_module

    texts = ["The plan failed again and again.", "A quiet walk by the river."]
    ref = str(tiny_llama_dir)
    cold = SteeringWorker(load_model(ref, device="cpu")).reference_nll(texts, ref)
    worker = SteeringWorker(load_model(ref, device="cpu"))
    assert worker.prepare_reference(ref) is None
    monkeypatch.setattr(worker_module, "load_model", lambda *a, **k: pytest.fail("the reference loaded again"))
    warm = worker.reference_nll(texts, ref)
    assert [a.tolist() for a in warm] == [a.tolist() for a in cold]
    monkeypatch.undo()
    missing = str(tiny_llama_dir / "no-such-model")
    line = worker.prepare_reference(missing)
    assert line and "no-such-model" in line and "\n" not in line
    with pytest.raises(Exception, match="no-such-model"):
        worker.reference_nll(texts, missing)


@pytest.mark.slow
def test_a_real_reference_passes_on_concept_text_and_fails_shuffled_and_repeated():
    """SmolLM2-135M as the reference (Gemma's in a default run): word-shuffled on-concept text is far past the
    guard on perplexity (measured 29x fluent text with hand-written passages), a repeated token on both measures."""
    loaded = load_model("embedded", dtype="float32", device="cpu")
    on_concept, unsteered = _corpus_texts()
    assert _through_d2(loaded, unsteered, on_concept) == ("chosen", True, True)
    assert _through_d2(loaded, unsteered, _shuffled(on_concept)) == ("no_alpha_fluent", False, False)
    assert _through_d2(loaded, unsteered, ["!" * 40] * N) == ("no_alpha_fluent", False, False)
    nll, n_tok = reference_nll(loaded, _shuffled(on_concept) + on_concept)
    shuffled_ppl = math.exp(nll[:N].sum() / n_tok[:N].sum())
    assert shuffled_ppl > 2 * DEFAULT_FLUENCY_GUARD * math.exp(nll[N:].sum() / n_tok[N:].sum())


def test_the_answer_reports_steering_and_prompting_under_the_guard_the_records_applied():
    """A D2 v4 record whose prompted text is under the perplexity bound (ratio 1.1) but loops (distinct-2 0.2):
    the answer says the prompted text fails, as the record's guard did, and the steered text at alpha* passes."""
    from poolbench.results.answer.answer import answer_html, build_answer

    record = {"concept": "c1", "strategy": "A", "layer": 2, "status": "ok", "alpha_star": 0.1, "null_reason": None,
              "fluency_guard": 2.0, "min_distinct_2": 0.5, "reference_model": "embedded-gemma",
              "d2_delta": 0.1, "d2_delta_ci_low": 0.05, "d2_delta_ci_high": 0.15, "passes_fluency_guard": True,
              "prompted_delta": 0.3, "prompted_delta_ci_low": 0.2, "prompted_delta_ci_high": 0.4,
              "prompted_fluency_ratio": 1.1, "prompted_distinct_2": 0.2, "prompted_passes_fluency_guard": False}
    answer = build_answer({"model": {"model_id": "m"}, "d2": [record]}, {"strategies": []})
    (cell,) = answer.steering
    assert (cell.steering_fluent, cell.prompted_fluent) == (True, False)
    assert "<th>steered fluent</th><th>prompted fluent</th>" in answer_html(answer)
    assert "<td>yes</td><td>no</td></tr>" in answer_html(answer)
