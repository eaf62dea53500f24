"""The OpenAI-compatible routes' work on the compute thread: a batch of completion jobs (from /v1/completions and
/v1/chat/completions alike) per model, every job's rows in one engine call per generation settings (each row with
its own steering delta, as /generate's are), then the log-probabilities a job asked for, one forward per row under
its own delta. A bad job fails alone, never the batch it shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from poolbench.errors import PoolBenchError
from poolbench.http.batching import answer_grouped
from poolbench.http.handlers import request_rows
from poolbench.http.model_caches import ModelCache, SteeringEngines, VectorCache
from poolbench.http.openai_schemas import Steering
from poolbench.http.schemas import GenerateRequest, StoredVector
from poolbench.http.service_errors import NotServed, RequestError, ServiceError
from poolbench.http.settings import ServiceSettings, vectors_of_run
from poolbench.http.text_pooling import strategy_spec


@dataclass
class CompletionJob:
    """One request as the handler needs it: prompts as text (`plain`: the tokenizer adds its special tokens) or
    token ids, or chat messages rendered with the model's chat template; `on_text(row, text)` sees each row's text
    as it grows (streaming)."""

    model: str
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    messages: list[dict] | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int = 0
    steering: Steering | None = None
    logprobs: int | None = None  # top log-probabilities per token; None: none asked
    echo: bool = False
    stops: list[str] = field(default_factory=list)
    include_usage: bool = False  # a stream's last event carries the usage counts
    on_text: Callable[[int, str], None] | None = None


@dataclass
class ScoredTokens:
    """Per token of a row (prompt and continuation): its id, text, log-probability (None for the first) and the
    top log-probabilities at its position."""

    ids: list[int]
    tokens: list[str]
    logprobs: list[float | None]
    top: list[dict[str, float] | None]


@dataclass
class RowResult:
    prompt_text: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    scored: ScoredTokens | None = None


@dataclass
class JobResult:
    model_id: str
    rows: list[RowResult]


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the first stop string, and whether one was found."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return (text[:min(cuts)], True) if cuts else (text, False)


def steering_delta(steering: Steering | None, loaded, vectors: VectorCache, settings: ServiceSettings,
                   ) -> tuple[int, np.ndarray | None]:
    """(layer, delta) of a request's steering field, checked as /generate checks its vector; (0, None) unsteered.
    A run, concept or strategy this service has no vector for is a 404 naming the field (`param`), as an unknown
    model is; a vector it cannot add as asked is a 400 naming it."""
    if steering is None or steering.alpha == 0:
        return 0, None
    if steering.run is not None:
        theirs = vectors_of_run(Path(steering.run)) if (Path(steering.run) / "results.json").is_file() else {}
        if not theirs or theirs.get("pooled_keys") != settings.pooled_keys:
            raise NotServed(f"steering.run: '{steering.run}' is not the run this service serves vectors of",
                            param="steering.run")
    if steering.concept is not None:
        if steering.concept not in settings.pooled_keys:
            raise NotServed(f"steering.concept: no stored vectors for '{steering.concept}' (run concepts: "
                            f"{', '.join(sorted(settings.pooled_keys)) or 'none'})", param="steering.concept")
        try:
            strategy_spec(steering.strategy)
        except PoolBenchError as exc:
            raise NotServed(f"steering.strategy: {str(exc).splitlines()[0]}", param="steering.strategy") from exc
    layer = steering.layer
    if layer is None:
        layers = sorted({int(k.rsplit("/", 1)[1]) for k in settings.residual_norms
                         if k.rsplit("/", 1)[0] == steering.concept})
        if len(layers) != 1:
            raise RequestError(f"steering.layer: the run steered '{steering.concept}' at "
                               f"{'layers ' + ', '.join(map(str, layers)) if layers else 'no layer'}; name one",
                               param="steering.layer")
        layer = layers[0]
    stored = None if steering.concept is None else StoredVector(concept=steering.concept, strategy=steering.strategy,
                                                                 unit=steering.unit)
    req = GenerateRequest(model=loaded.model_id, prompts=["-"], layer=layer, vector=steering.vector, stored=stored,
                          alpha=steering.alpha, max_new_tokens=1)
    try:
        return layer, request_rows(req, loaded, vectors)[0].delta
    except ServiceError as exc:
        if exc.param is None:  # /generate's messages name its own fields: here they are the steering field's
            field = str(exc).split(":", 1)[0]
            exc.param = (f"steering.{field}" if field in ("layer", "vector")
                         else "steering.layer" if "no pooled cell" in str(exc) else "steering")
        raise
    except PoolBenchError as exc:
        if "no pooled cell" not in str(exc):
            raise
        raise NotServed(f"steering.strategy: {str(exc).splitlines()[0]}", param="steering.strategy") from exc


def score_tokens(loaded, ids: list[int], layer: int, delta: np.ndarray | None, k: int) -> ScoredTokens:
    """Each token's log-probability given the ones before it (the model steered as the row was) and the top k."""
    import torch

    from poolbench.extractor.hook_points import add_hooks

    tok = loaded.tokenizer
    hooks = {}
    if delta is not None:
        added = torch.as_tensor(delta, dtype=loaded.dtype, device=loaded.device)
        hooks[f"layers.{layer}.out"] = lambda hidden: hidden + added
    with torch.no_grad(), add_hooks(loaded.decoder_layers, hooks):
        logits = loaded.model(input_ids=torch.tensor([ids], device=loaded.device)).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp[:-1].gather(1, torch.tensor(ids[1:], device=logp.device)[:, None])[:, 0].tolist()
    top: list[dict[str, float] | None] = [None]
    for t in range(1, len(ids)):
        values, index = torch.topk(logp[t - 1], k) if k > 0 else (logp[t - 1][:0], logp[t - 1][:0].long())
        row: dict[str, float] = {}
        for v, j in zip(values.tolist(), index.tolist(), strict=True):
            row.setdefault(tok.decode([int(j)]), float(v))  # two ids may read as one text: the likelier one stays
        row.setdefault(tok.decode([ids[t]]), float(picked[t - 1]))
        top.append(row)
    return ScoredTokens(list(ids), [tok.decode([i]) for i in ids], [None, *map(float, picked)], top)


def _prompts(job: CompletionJob, loaded) -> tuple[list[str], str, list[list[int]] | None]:
    """The job's prompts as the backend reads them, their prompt format, and the exact ids where it sent ids."""
    tok = loaded.tokenizer
    if job.messages is not None:
        if not getattr(tok, "chat_template", None):
            raise RequestError(f"messages: model '{loaded.model_id}' has no chat template; use /v1/completions")
        return [tok.apply_chat_template(job.messages, tokenize=False, add_generation_prompt=True)], "rendered", None
    if job.ids is not None:
        bad = [i for row in job.ids for i in row if not 0 <= i < len(tok)]
        if bad:
            raise RequestError(f"prompt: token id {bad[0]} out of the vocabulary (0..{len(tok) - 1})")
        return [tok.decode(row) for row in job.ids], "rendered", job.ids
    return list(job.texts or []), "plain", None


def _check(job: CompletionJob, texts: list[str], settings: ServiceSettings) -> None:
    if len(texts) > settings.max_texts:
        raise RequestError(f"prompt: {len(texts)} prompts, at most {settings.max_texts} per request")
    long = [i for i, t in enumerate(texts) if len(t) > settings.max_chars]
    if long:
        raise RequestError(f"prompt[{long[0]}]: {len(texts[long[0]])} characters, at most {settings.max_chars}")
    if job.max_tokens > settings.max_new_tokens:
        raise RequestError(f"max_tokens: {job.max_tokens}, at most {settings.max_new_tokens}")


def completions_many(jobs: list[CompletionJob], *, settings: ServiceSettings, models: ModelCache,
                     engines: SteeringEngines, vectors: VectorCache) -> list[JobResult | PoolBenchError]:
    """A batch of completion jobs: per model, per (generation settings, prompt format) one engine call of every
    job's rows, each with its own delta, layer and seed; then the log-probabilities asked for."""
    from poolbench.steerer.backend import Generation, GenerationSettings
    from poolbench.steerer.generation_rows import GenerationRow, generate_groups
    from poolbench.steerer.prompts import encode_prompts

    def answer(loaded, group: list[CompletionJob]) -> list[JobResult | PoolBenchError]:
        out: list[JobResult | PoolBenchError | None] = [None] * len(group)
        prepared: dict[int, tuple[list[str], str, list[list[int]] | None, int, np.ndarray | None]] = {}
        calls: dict[tuple[GenerationSettings, str], list[tuple[int, list[GenerationRow]]]] = {}
        for i, job in enumerate(group):
            try:
                texts, fmt, ids = _prompts(job, loaded)
                _check(job, texts, settings)
                layer, delta = steering_delta(job.steering, loaded, vectors, settings)
            except PoolBenchError as exc:
                out[i] = exc
                continue
            prepared[i] = (texts, fmt, ids, layer, delta)
            if job.max_tokens > 0:
                gen = GenerationSettings(max_new_tokens=job.max_tokens, temperature=max(job.temperature, 1e-6),
                                         greedy=job.temperature == 0, min_new_tokens=0)
                calls.setdefault((gen, fmt), []).append(
                    (i, [GenerationRow(t, delta, job.seed + r, layer) for r, t in enumerate(texts)]))
        generated: dict[int, list[Generation]] = {}
        for (gen, fmt), batch in calls.items():
            so_far: dict[tuple[int, int], list[int]] = {}

            def on_token(g: int, r: int, token: int, batch=batch, so_far=so_far) -> None:
                job = group[batch[g][0]]
                if job.on_text is not None:
                    ids = so_far.setdefault((g, r), [])
                    ids.append(token)
                    job.on_text(r, loaded.tokenizer.decode(ids, skip_special_tokens=True))

            try:
                answers = generate_groups(engines.backend(group[batch[0][0]].model, loaded),
                                          [rows for _, rows in batch], gen, fmt, on_token=on_token)
            except PoolBenchError as exc:
                for i, _ in batch:
                    out[i] = exc
                continue
            for (i, _), gens in zip(batch, answers, strict=True):
                generated[i] = gens
        for i, (texts, fmt, ids, layer, delta) in prepared.items():
            if out[i] is not None:
                continue
            job = group[i]
            try:
                out[i] = JobResult(loaded.model_id, [
                    _row(job, loaded, texts[r], ids[r] if ids is not None else None, fmt,
                         generated[i][r] if i in generated else None, layer, delta, encode_prompts)
                    for r in range(len(texts))])
            except PoolBenchError as exc:
                out[i] = exc
        return out  # type: ignore[return-value]

    return answer_grouped(jobs, lambda j: j.model, models.use, answer)


def _row(job: CompletionJob, loaded, text: str, given_ids: list[int] | None, fmt: str, gen, layer: int,
         delta: np.ndarray | None, encode_prompts) -> RowResult:
    prompt_ids = list(given_ids) if given_ids is not None else (
        list(gen.prompt_ids) if gen is not None else encode_prompts(loaded.tokenizer, [text], fmt)[0])
    token_ids = list(gen.token_ids) if gen is not None else []
    eos = loaded.tokenizer.eos_token_id
    if eos is not None and eos in token_ids:
        token_ids = token_ids[:token_ids.index(eos)]
    out_text, stopped = cut_at_stop(gen.text if gen is not None else "", job.stops)
    finish = "stop" if stopped or len(token_ids) < job.max_tokens else "length"
    scored = None
    if job.logprobs is not None:
        scored = score_tokens(loaded, prompt_ids + token_ids, layer, delta, job.logprobs)
    return RowResult(text, prompt_ids, token_ids, out_text, finish, scored)
