"""The OpenAI-compatible routes of the one Serve app, called with the real `openai` client on loopback: models,
completions and chat completions equal to PoolBench's own transformers backend at the same delta, streaming whose
first events arrive while the rows are still generated, usage, echo + logprobs with max_tokens 0, steering by a
run's stored vector or a raw one, concurrent requests with different vectors unmixed, OpenAI-shaped errors (the
client's exception class, message and param) for every failure, overload (429) included."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from planted_run import PLANTED, D, store_planted_table
from s3_server import free_port
from serve_health import wait_healthy
from tiny_models import CHAT_TEMPLATE, save_tiny_llama
from tolerances import assert_float32_close

from poolbench.extractor.loading import load_model
from poolbench.steerer.backend import GenerationSettings
from poolbench.steerer.transformers_backend import TransformersBackend

RESIDUAL_NORM = 6.0
STORED = (RESIDUAL_NORM * PLANTED / np.linalg.norm(PLANTED)).astype(np.float32)  # the alpha = 1 delta, by hand
TOKEN = "openai-test-token-0123456789"
PROMPTS = ["the cat sat on", "birds sang in the trees near the river"]
MAX_BODY = 100_000  # the app's body limit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Llama at weight std 0.2 (a delta at layer 1 changes its text) with a chat template."""
    from transformers import AutoTokenizer

    path = save_tiny_llama(tmp_path_factory.mktemp("models") / "chat-llama", weight_std=0.2)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run folder as /v1 reads it: the store, the pooled table (train DiffMean = PLANTED at layer 1) and a D2 cell
    at layer 1 with its residual norm."""
    root = tmp_path_factory.mktemp("run")
    store_planted_table(root / "store")
    (root / "out").mkdir()
    (root / "out" / "results.json").write_text(json.dumps({
        "config": {"store": str(root / "store")}, "artifacts": {"praise": {"pooled": "pooled/praise"}},
        "d2": [{"concept": "praise", "strategy": "A1_mean", "layer": 1, "residual_norm": RESIDUAL_NORM}]}))
    return root / "out"


@pytest.fixture(scope="module")
def client(model_dir, run, local_ray) -> Iterator[openai.OpenAI]:
    from ray import serve

    from poolbench.http.app import start_serve
    from poolbench.http.settings import ServiceSettings, vectors_of_run

    settings = ServiceSettings(models=(str(model_dir),), max_new_tokens=64, device="cpu", token=TOKEN,
                               max_body_bytes=MAX_BODY, **vectors_of_run(run))
    base = start_serve(settings, port=free_port(), num_cpus=0.5)
    wait_healthy(base, 60)
    try:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def reference(model_dir) -> TransformersBackend:
    return TransformersBackend(load_model(str(model_dir), device="cpu"))


def expected(reference, prompts, delta, n, fmt="plain"):
    settings = GenerationSettings(max_new_tokens=n, greedy=True, min_new_tokens=0)
    return reference.generate(prompts, layer=1, delta=delta, seeds=list(range(len(prompts))), settings=settings,
                              prompt_format=fmt)


def test_models_and_completions_steered_by_a_stored_vector_equal_the_backend(client, model_dir, reference):
    assert [m.id for m in client.models.list().data] == [str(model_dir)]
    steer = {"steering": {"concept": "praise", "alpha": 1.5}}  # layer: the run's D2 layer, 1
    got = client.completions.create(model=str(model_dir), prompt=PROMPTS, max_tokens=8, temperature=0,
                                    extra_body=steer)
    want = expected(reference, PROMPTS, 1.5 * STORED.astype(np.float64), 8)
    assert [c.text for c in got.choices] == [g.text for g in want]
    plain = expected(reference, PROMPTS, None, 8)
    assert [g.token_ids for g in want] != [g.token_ids for g in plain]  # the vector steers
    assert got.usage.prompt_tokens == sum(len(g.prompt_ids) for g in want)
    assert got.usage.completion_tokens == sum(len(g.token_ids) for g in want)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    assert [c.finish_reason for c in got.choices] == ["length" if len(g.token_ids) == 8 else "stop" for g in want]


@pytest.mark.numerics
def test_echo_logprobs_with_no_new_tokens_score_the_prompt_as_the_model_does(model_dir, reference):
    """Against the ingress app under uvicorn (no Ray): `make test` reruns this under each CPU kernel set, and a Serve
    app per rerun would cost more than the comparison; the routes are the same code."""
    from poolbench.http.settings import ServiceSettings

    with served_by_uvicorn(ServiceSettings(models=(str(model_dir),), max_new_tokens=64, device="cpu")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        got = client.completions.create(model=str(model_dir), prompt=PROMPTS[1], max_tokens=0, echo=True,
                                        logprobs=2, temperature=0, extra_body={"steering": {
                                            "vector": (2 * STORED).tolist(), "layer": 1, "alpha": 0.75}})
    lp = got.choices[0].logprobs
    m = reference.loaded
    ids = m.tokenizer(PROMPTS[1])["input_ids"]
    assert got.choices[0].text == PROMPTS[1] and len(lp.tokens) == len(ids) and got.usage.completion_tokens == 0
    added = torch.as_tensor(1.5 * STORED)
    with torch.no_grad():
        handle = m.decoder_layers[1].register_forward_hook(lambda _m, _i, out: (out[0] + added, *out[1:])
                                                            if isinstance(out, tuple) else out + added)
        try:
            logp = torch.log_softmax(m.model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        finally:
            handle.remove()
    want = np.array([logp[t - 1, ids[t]].item() for t in range(1, len(ids))])
    assert lp.token_logprobs[0] is None
    assert_float32_close(lp.token_logprobs[1:], want, terms=D * len(m.tokenizer), scale=float(logp.abs().max()))
    for t in range(1, len(ids)):  # the top 2 hold the position's best token
        assert max(lp.top_logprobs[t].values()) == pytest.approx(logp[t - 1].max().item(), abs=1e-4)


def test_a_stream_sends_text_while_the_rows_are_generated(client, model_dir, reference):
    client.completions.create(model=str(model_dir), prompt="warm", max_tokens=1)  # the model loaded before timing
    started = time.perf_counter()
    stream = client.completions.create(model=str(model_dir), prompt=PROMPTS[0], max_tokens=64, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    arrivals, texts, usage, finish = [], [], None, None
    for chunk in stream:
        arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts.append(c.text)
            finish = c.finish_reason or finish
    want = expected(reference, [PROMPTS[0]], None, 64)[0]
    assert "".join(texts) == want.text and finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens == len(want.token_ids)
    assert sum(1 for t in texts if t) > 3
    # Buffered until the end, every event would arrive within a few ms of the last; streamed, the first comes
    # while the 64 tokens are still drawn.
    assert arrivals[-1] - arrivals[0] > 0.25 * (arrivals[-1] - started)


def test_chat_completion_reads_the_messages_through_the_chat_template(client, model_dir, reference):
    got = client.chat.completions.create(model=str(model_dir), messages=[{"role": "user", "content": PROMPTS[0]}],
                                         max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"steering": {"concept": "praise", "layer": 1, "alpha": 1.5}})
    want = expected(reference, [PROMPTS[0]], 1.5 * STORED.astype(np.float64), 6, fmt="chat")[0]
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(want.prompt_ids)
    content = got.choices[0].logprobs.content  # greedy: each token is the top one at its position
    assert len(content) == len(want.token_ids)
    assert all(t.logprob == max(a.logprob for a in t.top_logprobs) for t in content)
    chunks = client.chat.completions.create(model=str(model_dir), messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=6, temperature=0, stream=True, extra_body={"steering": {
                                                "concept": "praise", "layer": 1, "alpha": 1.5}})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text


def test_concurrent_requests_with_different_vectors_never_mix(client, model_dir):
    rng = np.random.default_rng(7)
    vectors = [None, *(8 * v / np.linalg.norm(v) for v in rng.normal(size=(2, D)))]

    def ask(k: int, prompt: str) -> str:
        extra = {} if vectors[k] is None else {"steering": {"vector": vectors[k].tolist(), "layer": 1, "alpha": 1}}
        return client.completions.create(model=str(model_dir), prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body=extra).choices[0].text

    jobs = [(k, p) for p in PROMPTS for k in range(3)] * 2
    alone = {job: ask(*job) for job in dict.fromkeys(jobs)}
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: ask(*job), jobs))
    assert together == [alone[job] for job in jobs]
    assert len({alone[(k, PROMPTS[0])] for k in range(3)}) == 3  # each vector steers elsewhere


def test_errors_have_openai_s_shape_status_and_param(client, model_dir):
    """Each failure reaches the openai client as its own exception class, with OpenAI's body naming the field."""
    model = str(model_dir)

    def fails(kind: type[openai.APIStatusError], call) -> dict:
        with pytest.raises(kind) as caught:
            call()
        assert type(caught.value) is kind and set(caught.value.body) == {"message", "type", "param", "code"}
        return caught.value.body

    body = fails(openai.NotFoundError, lambda: client.completions.create(model="nope", prompt="x"))
    assert body == {"message": f"model: 'nope' is not served here (served: {model})", "type": "not_found_error",
                    "param": "model", "code": "model_not_found"}
    body = fails(openai.BadRequestError, lambda: client.completions.create(model=model, prompt="x", temperature=5))
    assert body == {"message": "temperature: Input should be less than or equal to 2", "param": "temperature",
                    "type": "invalid_request_error", "code": None}
    body = fails(openai.BadRequestError, lambda: client.completions.create(model=model, prompt="x", n=2))
    assert (body["message"], body["param"]) == ("n: 2, only 1 is supported", "n")
    body = fails(openai.BadRequestError, lambda: client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}],
        extra_body={"steering": {"concept": "praise", "alpha": "strong"}}))
    assert body["param"] == "steering.alpha" and body["message"].startswith("steering.alpha: Input should be")
    body = fails(openai.BadRequestError, lambda: client.completions.create(model=model, prompt="x", extra_body={
        "steering": {"vector": STORED.tolist(), "layer": 9, "alpha": 1}}))
    assert body["message"].startswith("layer: 9 out of range") and body["param"] == "steering.layer"
    body = fails(openai.BadRequestError, lambda: client.completions.create(model=model, prompt="x", max_tokens=65,
                                                                          stream=True))
    assert (body["message"], body["param"]) == ("max_tokens: 65, at most 64", "max_tokens")
    for field, steering, message in [
            ("concept", {"concept": "nope"}, "steering.concept: no stored vectors for 'nope' (run concepts: praise)"),
            ("strategy", {"concept": "praise", "strategy": "Z9_nope"}, "steering.strategy: "),
            ("strategy", {"concept": "praise", "strategy": "P1_last"},
             "steering.strategy: concept 'praise': no pooled cell (layer 1, strategy 'P1_last')"),
            ("run", {"concept": "praise", "run": "/no/such/run"},
             "steering.run: '/no/such/run' is not the run this service serves vectors of")]:
        body = fails(openai.NotFoundError, lambda s=steering: client.completions.create(
            model=model, prompt="x", extra_body={"steering": {**s, "alpha": 1}}))
        assert body["message"].startswith(message) and body["param"] == f"steering.{field}"
        assert body["type"] == "not_found_error"
    body = fails(openai.NotFoundError, lambda: client.embeddings.create(model=model, input="x"))  # no such route
    assert body == {"message": "Not Found", "type": "not_found_error", "param": None, "code": "unknown_url"}
    body = fails(openai.APIStatusError, lambda: client.completions.create(model=model, prompt="x" * MAX_BODY))
    assert body["type"] == "invalid_request_error" and body["code"] == "request_too_large"
    assert body["message"].startswith("request body is ") and body["message"].endswith(f"at most {MAX_BODY}")
    body = fails(openai.AuthenticationError, lambda: openai.OpenAI(
        base_url=str(client.base_url), api_key="wrong-token-wrong-token", max_retries=0).models.list())
    assert body == {"message": "missing or wrong bearer token", "type": "authentication_error", "param": None,
                    "code": "invalid_api_key"}


def test_a_body_that_is_no_json_is_a_bad_request_and_poolbench_s_routes_keep_their_shape(client, model_dir):
    """The openai client always sends JSON: a broken body is posted raw and read by the client's own mapping
    from a response to its exception; /generate answers the same body in PoolBench's {"detail"} shape."""
    auth = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    base = str(client.base_url).removesuffix("/v1/")
    reply = httpx.post(f"{base}/v1/completions", content=b'{"model": "x", "prompt": ', headers=auth)
    error = client._make_status_error_from_response(reply)
    assert type(error) is openai.BadRequestError and error.param is None and error.type == "invalid_request_error"
    assert error.body["message"] == "body: not valid JSON at character 25 (Expecting value)"
    own = httpx.post(f"{base}/generate", content=b'{"model": "x", "prompts": ', headers=auth)
    assert own.status_code == 422 and own.json()["detail"] == "body: not valid JSON at character 26 (Expecting value)"
    own = httpx.post(f"{base}/generate", json={"model": "nope", "prompts": ["x"], "layer": 1}, headers=auth)
    assert own.status_code == 404 and set(own.json()) == {"detail"}


@contextmanager
def served_by_uvicorn(settings) -> Iterator[str]:
    """The ingress app Serve runs (build_api) under uvicorn on loopback, without Ray: its base URL."""
    import threading

    import uvicorn

    from poolbench.http.app import build_api

    server = uvicorn.Server(uvicorn.Config(build_api(settings), host="127.0.0.1", port=free_port(),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def one_slot_app(model_dir) -> Iterator[str]:
    """One working slot and no queue: a request whose body has not arrived holds its slot there for sure (Serve's
    proxy may hold such a request before the replica sees it, so through Serve the test could not know when the
    service is full)."""
    from poolbench.http.settings import ServiceSettings

    with served_by_uvicorn(ServiceSettings(models=(str(model_dir),), max_new_tokens=8, device="cpu", max_working=1,
                                           max_queued=0)) as base:
        yield base


def test_a_full_service_answers_429_rate_limit_error_then_serves_again(one_slot_app, model_dir):
    """A request whose body has not arrived holds the one slot; the next /v1/ call is a RateLimitError with
    Retry-After (the openai client's own backoff reads it); once it goes, the service answers again."""
    client = openai.OpenAI(base_url=f"{one_slot_app}/v1", api_key="none", max_retries=0, timeout=60)
    host, port = client.base_url.host, client.base_url.port
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n{").encode()
    with socket.create_connection((host, port)) as stalled:
        stalled.sendall(head)
        deadline = time.monotonic() + 30
        while True:  # a probe that came before the stalled request reached the app is served: ask again
            try:
                client.completions.create(model=str(model_dir), prompt="x", max_tokens=1)
            except openai.RateLimitError as exc:
                refused = exc
                break
            assert time.monotonic() < deadline, "the stalled request never held the slot"
            time.sleep(0.1)
    assert type(refused) is openai.RateLimitError and refused.status_code == 429
    assert refused.body == {"message": "busy: 1 requests working and 0 queued (at most 0); retry after 1 s",
                            "type": "requests", "param": None, "code": "rate_limit_exceeded"}
    assert refused.response.headers["retry-after"] == "1"
    deadline = time.monotonic() + 30
    while True:
        try:
            assert client.completions.create(model=str(model_dir), prompt="x", max_tokens=1).choices
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the service stayed full after the stalled request went"
            time.sleep(0.1)
