"""The one Serve application over real HTTP: one app on a free port for the module, the tiny Llama behind it and
the scorers of a (hand-written) run folder for /score; concurrent load, body limits while streaming, NaN."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
import torch
from s3_server import free_port
from serve_health import wait_healthy
from transformers import AutoModelForCausalLM, AutoTokenizer

from poolbench.corpus.passage import Passage
from poolbench.http.app import start_serve
from poolbench.http.service_errors import ServiceConfigError
from poolbench.http.settings import ServiceSettings, check_scorers, scorers_of_run, vectors_of_run
from poolbench.pooler.pooled_table import PooledTableBuilder
from poolbench.prober.d1 import evaluate_d1
from poolbench.scorer.artifacts import ensure_scorer, scorer_record
from poolbench.scorer.finetune import ScorerConfig
from poolbench.store.local import LocalStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import serve_load  # bench/ holds scripts, not a package

POS = ["I might perhaps be wrong about this", "it could possibly rain later today", "maybe we should wait a bit",
       "perhaps the answer is not so clear", "it seems likely that it might work", "possibly the train is late"]
NEG = ["the answer is four", "the train leaves at noon", "we leave now", "water boils at one hundred degrees",
       "the door is red", "she owns two cats"]


PLANTED = np.array([3.0, -4.0] + [0.0] * 30, np.float32)  # |PLANTED| = 5, unit direction (0.6, -0.8, 0, ...)
RESIDUAL_NORM = 40.0


@pytest.fixture(scope="module")
def scored_run(tiny_encoder, tmp_path_factory):
    """A run folder as `poolbench-driver run` leaves it, as far as /score and /generate read it: the store in
    config, the scorers' records (with their keys), the pooled table's key and a D2 cell's residual norm in
    results.json; one scorer, for 'praise', trained on the tiny encoder; its pooled table (A1_mean at layer 1,
    d = 32) planted so the train DiffMean is PLANTED."""
    root = tmp_path_factory.mktemp("run")
    passages = [Passage(f"{split}-{i}-{label}", text, label, "d", 4, f"{split}-{i}", split, "praise")
                for i, (pos, neg) in enumerate(zip(POS, NEG, strict=True))
                for split in ["train" if i < 4 else "test"] for label, text in ((1, pos), (0, neg))]
    config = ScorerConfig(encoder=str(tiny_encoder), epochs=1, batch_size=8, max_length=16)
    store = LocalStore(root / "store")
    scorer = ensure_scorer(store, "praise", passages, "h", config, allow_weak=True)
    vecs = np.zeros((len(passages), 32), np.float32)
    vecs[[p.label == 1 for p in passages]] = PLANTED
    builder = PooledTableBuilder(passages, 32)
    builder.add(vecs[None, None], [1], ["A1_mean"], [p.id for p in passages], np.zeros(len(passages), bool))
    store.put_table("pooled/praise-test", builder.table())
    (root / "out").mkdir()
    (root / "out" / "results.json").write_text(json.dumps({
        "config": {"store": str(root / "store")}, "scorers": [scorer_record(scorer).to_dict()],
        "artifacts": {"praise": {"pooled": "pooled/praise-test", "d1": "d1/x"}},
        "d2": [{"concept": "praise", "strategy": "P1_last", "layer": 1, "residual_norm": RESIDUAL_NORM}]}))
    return root / "out", scorer


@pytest.fixture(scope="module")
def service(tiny_llama_dir, scored_run, local_ray) -> Iterator[tuple[str, str]]:
    from ray import serve

    settings = ServiceSettings(models=(str(tiny_llama_dir),), max_texts=16, max_chars=200, max_body_bytes=8192,
                               max_new_tokens=8, device="cpu", **scorers_of_run(scored_run[0]),
                               **vectors_of_run(scored_run[0]))
    base = start_serve(settings, port=free_port(), num_cpus=0.5)
    wait_healthy(base, 60)
    try:
        yield base, str(tiny_llama_dir)
    finally:
        serve.shutdown()


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=60)


def items() -> list[dict]:
    """4+4 train, 2+2 test; each positive paired with the negative of the same index (a matched pair)."""
    out = []
    for i, (p, n) in enumerate(zip(POS, NEG, strict=True)):
        split = "train" if i < 4 else "test"
        out += [{"text": p, "label": 1, "split": split, "group": f"g{i}"},
                {"text": n, "label": 0, "split": split, "group": f"g{i}"}]
    return out


def test_healthz_and_openapi_and_loopback_binding(service):
    base, model = service
    assert base.startswith("http://127.0.0.1:")
    assert httpx.get(f"{base}/healthz").json() == {"status": "ok", "models": [model], "scorers": ["praise"],
                                                   "vectors": ["praise"]}
    spec = httpx.get(f"{base}/openapi.json").json()
    assert {"/pool", "/probe", "/score", "/generate", "/healthz"} <= set(spec["paths"])
    assert "PoolRequest" in spec["components"]["schemas"]


def test_score_answers_for_the_runs_concept_with_its_scorer(service, scored_run):
    base, _ = service
    texts = ["I might perhaps be wrong about this", "the door is red"]
    reply = post(base, "/score", {"concept": "praise", "texts": texts})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert set(body) == {"concept", "scores", "heldout_auroc"} and body["concept"] == "praise"
    np.testing.assert_allclose(body["scores"], scored_run[1].score(texts), rtol=1e-6)
    assert body["heldout_auroc"] == scored_run[1].info["heldout_auroc"]
    schema = httpx.get(f"{base}/openapi.json").json()["components"]["schemas"]["ScoreResponse"]
    assert "P(concept | text)" in schema["properties"]["scores"]["description"]


def test_a_run_without_scorers_or_a_missing_scorer_fails_in_one_line(tmp_path, scored_run):
    with pytest.raises(ServiceConfigError, match="no such file"):
        scorers_of_run(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"config": {"store": None}, "cells": []}))
    with pytest.raises(ServiceConfigError, match="the run recorded no scorers"):
        scorers_of_run(tmp_path)
    settings = ServiceSettings(**scorers_of_run(scored_run[0]))
    assert settings.scorer_concepts == ["praise"]
    check_scorers(settings)
    gone = ServiceSettings(scorer_store=settings.scorer_store, scorer_keys={"praise": "scorer/nope"})
    with pytest.raises(ServiceConfigError, match=r"^scorers not found: praise \(scorer/nope\)$"):
        check_scorers(gone)


def test_pool_mean_equals_the_models_hidden_states(service, tiny_llama_dir):
    base, model = service
    texts = ["the cat sat on the mat", "perhaps it rains"]
    reply = post(base, "/pool", {"model": model, "layer": 0, "strategy": "A1", "texts": texts})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["strategy"] == "A1_mean" and body["dim"] == 32 and body["fallback"] == [False, False]
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    lm = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    for text, vector in zip(texts, body["vectors"], strict=True):
        with torch.no_grad():
            hidden = lm(**tok(text, return_tensors="pt"), output_hidden_states=True).hidden_states[1][0]
        np.testing.assert_allclose(vector, hidden.mean(0).numpy(), atol=1e-4)


def test_probe_equals_d1_on_the_pooled_vectors(service):
    base, model = service
    its = items()
    reply = post(base, "/probe", {"model": model, "layer": 1, "strategy": "A1_mean", "items": its,
                                  "n_folds": 2, "n_bootstrap": 200})
    assert reply.status_code == 200, reply.text
    got = reply.json()["probes"]
    pooled = post(base, "/pool", {"model": model, "layer": 1, "strategy": "A1_mean",
                                  "texts": [i["text"] for i in its]}).json()
    X = np.asarray(pooled["vectors"])
    y = np.array([i["label"] for i in its])
    g = np.array([i["group"] for i in its])
    tr = np.array([i["split"] == "train" for i in its])
    want = evaluate_d1(X[tr], y[tr], g[tr], X[~tr], y[~tr], g[~tr], n_folds=2, seed=0, n_bootstrap=200)
    assert set(got) == set(want.probes)
    for name, result in want.probes.items():
        assert got[name]["n_train"] == 8 and got[name]["n_test"] == 4
        for key in ("cv_auroc", "test_auroc", "ci_low", "ci_high"):
            assert got[name][key] == pytest.approx(getattr(result, key), abs=1e-6), (name, key)


def test_generate_steered_and_unsteered(service):
    base, model = service
    body = {"model": model, "prompts": ["the cat", "a dog"], "layer": 1, "max_new_tokens": 4, "greedy": True}
    plain = post(base, "/generate", body)
    assert plain.status_code == 200, plain.text
    assert [g["prompt"] for g in plain.json()["generations"]] == ["the cat", "a dog"]
    steered = post(base, "/generate", {**body, "vector": [1.0] * 32, "alpha": 50.0})
    assert steered.status_code == 200, steered.text
    assert steered.json()["generations"] != plain.json()["generations"]
    assert post(base, "/generate", {**body, "vector": [1.0] * 3, "alpha": 1.0}).json()["detail"] == \
        "vector: 3 floats, the model's hidden size is 32"
    # alpha 1e308 is finite, but alpha x vector is not in the model's fp32: 422, not 200 with empty text.
    huge = post(base, "/generate", {**body, "vector": [1.0] * 32, "alpha": 1e308})
    assert huge.status_code == 422 and huge.json()["detail"] == \
        "steering delta of row 0 has norm inf, over 1.84e+19, the largest the model's dtype carries: lower alpha"


def test_generate_with_a_stored_vector_of_the_run(service):
    base, model = service
    body = {"model": model, "prompts": ["the cat", "a dog"], "layer": 1, "max_new_tokens": 6, "greedy": True}
    plain = post(base, "/generate", body).json()["generations"]
    stored = post(base, "/generate", {**body, "stored": {"concept": "praise", "strategy": "A1"}, "alpha": 5.0})
    assert stored.status_code == 200, stored.text
    # alpha in D2's unit: alpha x the run's residual norm (40) x the unit DiffMean direction (0.6, -0.8, 0, ...).
    unit = [0.6 * RESIDUAL_NORM, -0.8 * RESIDUAL_NORM] + [0.0] * 30
    raw = post(base, "/generate", {**body, "vector": unit, "alpha": 5.0}).json()["generations"]
    assert stored.json()["generations"] == raw != plain
    # unit raw: alpha x the DiffMean vector itself, PLANTED = (3, -4, 0, ...).
    raw_unit = post(base, "/generate", {**body, "stored": {"concept": "praise", "unit": "raw"}, "alpha": 40.0})
    assert raw_unit.json()["generations"] == post(base, "/generate", {
        **body, "vector": PLANTED.tolist(), "alpha": 40.0}).json()["generations"]
    assert post(base, "/generate", {**body, "stored": {"concept": "praise"}, "alpha": 0.0}).json()[
        "generations"] == plain


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"stored": {"concept": "hedging"}, "alpha": 1.0}, 404, "no stored vectors for concept 'hedging' (run concepts: "
                                                            "praise)"),
    ({"stored": {"concept": "praise"}, "alpha": 1.0, "layer": 0}, 422,
     "the run measured no residual norm for 'praise' at layer 0 (no D2 cell there); use unit 'raw'"),
    ({"stored": {"concept": "praise", "unit": "raw"}, "alpha": 1.0, "layer": 0}, 422,
     "concept 'praise': no pooled cell (layer 0, strategy 'A1_mean')"),
    ({"stored": {"concept": "praise"}, "vector": [1.0] * 32, "alpha": 1.0}, 422,
     "give either vector (raw) or stored (a run's vector), not both"),
])
def test_stored_vector_errors_are_one_line(service, body, status, message):
    base, model = service
    reply = post(base, "/generate", {"model": model, "prompts": ["x"], "layer": 1, "max_new_tokens": 2, **body})
    assert reply.status_code == status, reply.text
    assert message in reply.json()["detail"] and "\n" not in reply.json()["detail"]


def test_vectors_of_a_run_read_its_pooled_keys_and_residual_norms(tmp_path, scored_run):
    assert vectors_of_run(scored_run[0]) == {"vector_store": str(scored_run[0].parent / "store"),
                                             "pooled_keys": {"praise": "pooled/praise-test"},
                                             "residual_norms": {"praise/1": RESIDUAL_NORM}}
    (tmp_path / "results.json").write_text(json.dumps({"config": {}, "artifacts": {}}))
    assert vectors_of_run(tmp_path) == {}
    with pytest.raises(ValueError, match="pooled_keys need vector_store"):
        ServiceSettings(pooled_keys={"praise": "pooled/x"})


@pytest.mark.parametrize(("path", "body", "status", "message"), [
    ("/pool", {"layer": 0, "texts": ["x"] * 17}, 422, "texts: 17 entries, at most 16 per request"),
    ("/pool", {"layer": 0, "texts": ["x" * 201]}, 422, "texts[0]: 201 characters, at most 200"),
    ("/pool", {"layer": 0, "texts": []}, 422, "texts: List should have at least 1 item"),
    ("/pool", {"layer": 0, "texts": ["x"], "colour": 1}, 422, "colour: Extra inputs are not permitted"),
    ("/pool", {"layer": -1, "texts": ["x"]}, 422, "layer: Input should be greater than or equal to 0"),
    ("/pool", {"layer": 7, "texts": ["x"]}, 422, "layer: 7 out of range"),
    ("/pool", {"layer": 0, "texts": ["x"], "strategy": "Z9"}, 422, "Z9"),
    ("/pool", {"layer": 0, "texts": ["x"], "model": "gpt2"}, 404, "model 'gpt2' is not served here"),
    ("/pool", {"layer": 0, "texts": ["x" * 100] * 100}, 413, "at most 8192"),
    ("/probe", {"layer": 0, "items": [{"text": "a", "label": 1, "split": "train"}] * 4}, 422,
     "items: the train split needs both labels 0 and 1, has [1]"),
    ("/score", {"concept": "hedging", "texts": ["x"]}, 404, "no scorer for concept 'hedging' (configured: praise)"),
    ("/generate", {"layer": 0, "prompts": ["x"], "max_new_tokens": 9}, 422, "max_new_tokens: 9, at most 8"),
])
def test_bad_requests_get_a_clear_status_and_message(service, path, body, status, message):
    base, model = service
    if "model" not in body and path != "/score":
        body = {**body, "model": model}
    reply = post(base, path, body)
    assert reply.status_code == status, reply.text
    assert message in reply.json()["detail"]
    assert "\n" not in reply.json()["detail"]


def test_repeated_pool_requests_answer_the_same_vectors(service):
    """Five identical /pool requests give the same 4 vectors bit for bit (latency is bench/serve_load.py's job)."""
    base, model = service
    body = {"model": model, "layer": 1, "strategy": "A1_mean", "texts": POS[:4]}
    replies = [post(base, "/pool", body) for _ in range(5)]
    assert [r.status_code for r in replies] == [200] * 5
    first = replies[0].json()["vectors"]
    assert len(first) == 4 and all(np.isfinite(v).all() for v in first)
    assert all(r.json()["vectors"] == first for r in replies[1:])


def test_concurrent_mixed_load_answers_as_each_request_alone(service, capsys):
    """16 clients fire /pool (A1, P1, A2, S1), /probe and /generate (steered at alpha 50, unsteered, sampled)
    at once; every answer must equal the same request served alone, bit for bit."""
    base, model = service
    summary = serve_load.run_load(base, model, [0, 1], clients=16, requests=48, time_limit_s=180)
    with capsys.disabled():
        print()
        serve_load.print_table(summary)
    assert summary["first_errors"] == [] and summary["errors"] == 0
    assert summary["mismatches"] == 0
    assert summary["completed"] == 48 and summary["distinct_requests"] == 12
    assert set(summary["endpoints"]) == {"/pool", "/probe", "/generate"}
    for row in summary["endpoints"].values():
        assert row["requests_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]


def test_serve_load_refuses_anything_but_loopback():
    serve_load.check_loopback("http://127.0.0.1:8000")
    serve_load.check_loopback("http://[::1]:8000")
    with pytest.raises(serve_load.LoadError, match="only targets loopback"):
        serve_load.check_loopback("http://10.0.0.5:8000")


@pytest.mark.parametrize(("path", "raw", "message"), [
    ("/generate", '{"prompts": ["x"], "layer": 0, "vector": [1.0], "alpha": NaN}', "alpha: Input should be a finite"),
    ("/generate", '{"prompts": ["x"], "layer": 0, "vector": [Infinity], "alpha": 1}', "vector.0: Input should be a"),
    ("/generate", '{"prompts": ["x"], "layer": 0, "temperature": Infinity}', "temperature: Input should be a fin"),
])
def test_nan_and_infinity_are_refused(service, path, raw, message):
    base, model = service
    reply = httpx.post(f"{base}{path}", content=raw.replace("{", f'{{"model": "{model}", ', 1),
                       headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 422, reply.text
    assert reply.json()["detail"].startswith(message)


def test_a_chunked_body_is_refused_while_it_streams(service):
    """A chunked body (no Content-Length) that passes the 8192-byte limit gets 413 and a closed connection while
    it is still open: the client sends 64 KiB, never the final chunk, and waits for the answer."""
    base, _ = service
    url = urlsplit(base)
    chunk = b"x" * 32768
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    answer = b""
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(b"POST /pool HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + frame + frame)
        # A server that waited for the whole body would never answer: the recv below times out and fails.
        while part := sock.recv(65536):
            answer += part
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"connection: close" in head.lower()
    assert json.loads(body)["detail"].startswith("request body passed 8192 bytes while streaming")


def test_openapi_states_every_limit(service):
    base, _ = service
    spec = httpx.get(f"{base}/openapi.json").json()
    description = spec["info"]["description"]
    for words in ("at most 8192 bytes, counted while it streams (chunked bodies too)", "at most 16 per request",
                  "each at most 200 characters", "max_new_tokens: at most 8", "n_bootstrap: at most 2000",
                  "NaN and Infinity are refused with 422", "scorers: praise", "stored vectors of the run for: praise"):
        assert words in description
    schemas = spec["components"]["schemas"]
    for model, field in (("PoolRequest", "texts"), ("ScoreRequest", "texts"), ("GenerateRequest", "prompts")):
        assert schemas[model]["properties"][field]["maxItems"] == 16
        assert schemas[model]["properties"][field]["items"]["maxLength"] == 200
    assert schemas["ProbeRequest"]["properties"]["items"]["maxItems"] == 16
    assert schemas["LabelledText"]["properties"]["text"]["maxLength"] == 200
    assert schemas["GenerateRequest"]["properties"]["max_new_tokens"]["maximum"] == 8
    assert schemas["ProbeRequest"]["properties"]["n_bootstrap"]["maximum"] == 2000


@pytest.mark.parametrize("greedy", [True, False])
def test_generate_requests_batched_together_answer_as_each_alone(layered_llama_dir, monkeypatch, greedy):
    """What a Serve batch of /generate requests runs: requests with different vectors, layers and alphas share one
    engine call (one generate_rows), and each gets exactly the texts it gets alone; a bad request fails alone."""
    from poolbench.http.handlers import generate_many
    from poolbench.http.model_caches import ModelCache, SteeringEngines, VectorCache
    from poolbench.http.schemas import GenerateRequest
    from poolbench.http.service_errors import RequestError
    from poolbench.steerer.transformers_backend import TransformersBackend

    settings = ServiceSettings(models=(str(layered_llama_dir),), device="cpu", max_new_tokens=8)
    services = {"models": ModelCache(settings), "engines": SteeringEngines(settings), "vectors": VectorCache(settings)}
    rng = np.random.default_rng(0)
    u, v = (rng.normal(size=32).tolist() for _ in range(2))
    model = str(layered_llama_dir)
    common = {"model": model, "max_new_tokens": 6, "greedy": greedy}
    reqs = [GenerateRequest(prompts=["the cat", "a dog"], layer=0, vector=u, alpha=0.5, **common),
            GenerateRequest(prompts=["a dog", "birds sang in the"], layer=1, vector=v, alpha=1.0, seed=3, **common),
            GenerateRequest(prompts=["the cat", "a dog"], layer=1, **common),  # unsteered
            GenerateRequest(prompts=["the cat"], layer=0, vector=[1.0] * 3, alpha=1.0, **common)]
    calls = []
    generate_rows = TransformersBackend.generate_rows

    def counted(self, prompts, **kwargs):
        calls.append(len(prompts))
        return generate_rows(self, prompts, **kwargs)

    monkeypatch.setattr(TransformersBackend, "generate_rows", counted)
    alone = [generate_many([r], **services)[0] for r in reqs]
    assert calls == [2, 2, 2]  # the bad request never reaches the engine
    calls.clear()
    together = generate_many(reqs, **services)
    assert calls == [6]  # three requests' rows in one call
    with services["models"].use(model) as loaded:
        assert str(loaded.dtype) == "torch.float32"
    for mine, single in zip(together[:3], alone[:3], strict=True):
        assert mine == single
    assert isinstance(together[3], RequestError) and str(together[3]) == str(alone[3]) == \
        "vector: 3 floats, the model's hidden size is 32"
    # The vectors steer (so equal answers could differ): same prompts and seeds, steered or not.
    steered, plain = together[0], together[2]
    assert [g.text for g in steered.generations] != [g.text for g in plain.generations]
