"""OpenAI-compatible routes on the one Serve app: GET /v1/models, POST /v1/completions and /v1/chat/completions,
`stream: true` as server-sent events sent while the rows are generated, steering through the `steering` extra field.

They sit behind the same middleware as /generate (bearer token, admission control, body limit) and run on the same
compute thread in batches (openai_handlers.completions_many): concurrent requests with different vectors share an
engine call, each row with its own delta. Errors on /v1/ paths have OpenAI's shape (openai_errors)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from poolbench.compute_thread import ComputeThread
from poolbench.errors import PoolBenchError
from poolbench.http.batching import answer_or_raise, batched
from poolbench.http.model_caches import ModelCache, SteeringEngines, VectorCache
from poolbench.http.openai_errors import openai_error
from poolbench.http.openai_handlers import CompletionJob, JobResult, RowResult, completions_many, cut_at_stop
from poolbench.http.openai_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ModelCard,
    ModelList,
    Steering,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from poolbench.http.service_errors import NotServed, RequestError
from poolbench.http.settings import ServiceSettings


def _usage(rows: list[RowResult]) -> Usage:
    prompt = sum(len(r.prompt_ids) for r in rows)
    completion = sum(len(r.token_ids) for r in rows)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def completion_choice(index: int, row: RowResult, echo: bool) -> CompletionChoice:
    """One choice: the continuation (after the prompt when echoed) and, where asked, OpenAI's legacy logprobs
    (with echo, every prompt token first: token_logprobs[0] is None)."""
    logprobs = None
    if row.scored is not None:
        s = row.scored
        start = 0 if echo else len(row.prompt_ids)
        tokens = s.tokens[start:len(row.prompt_ids) + len(row.token_ids)]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        logprobs = CompletionLogprobs(tokens=tokens, token_logprobs=s.logprobs[start:start + len(tokens)],
                                      top_logprobs=s.top[start:start + len(tokens)], text_offset=offsets)
    return CompletionChoice(index=index, text=(row.prompt_text if echo else "") + row.text, logprobs=logprobs,
                            finish_reason=row.finish_reason)  # type: ignore[arg-type]


def _chat_logprobs(row: RowResult, top: int) -> ChatLogprobs | None:
    if row.scored is None:
        return None
    s, start = row.scored, len(row.prompt_ids)
    content = []
    for t in range(start, start + len(row.token_ids)):
        alternatives = sorted((s.top[t] or {}).items(), key=lambda kv: -kv[1])[:top]
        content.append(TokenLogprob(token=s.tokens[t], logprob=float(s.logprobs[t] or 0.0),
                                    bytes=list(s.tokens[t].encode()),
                                    top_logprobs=[TopLogprob(token=k, logprob=v, bytes=list(k.encode()))
                                                  for k, v in alternatives]))
    return ChatLogprobs(content=content)


STEERING_HEADER = "x-poolbench-steering"  # the steering field as JSON, for clients that cannot add body fields


def request_steering(body: Steering | None, request: Request) -> Steering | None:
    """The body's `steering`, else the X-PoolBench-Steering header's (lm-evaluation-harness's `header` model arg)."""
    raw = request.headers.get(STEERING_HEADER)
    if body is not None or raw is None:
        return body
    try:
        return Steering.model_validate_json(raw)
    except ValueError as exc:
        raise RequestError(f"{STEERING_HEADER}: {str(exc).splitlines()[0]}; expected the steering field's JSON",
                           param="steering") from exc


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def add_openai_routes(api: FastAPI, settings: ServiceSettings, compute: ComputeThread, *, models: ModelCache,
                      engines: SteeringEngines, vectors: VectorCache) -> None:
    run_batch = batched(lambda jobs: completions_many(jobs, settings=settings, models=models, engines=engines,
                                                      vectors=vectors), settings, compute)

    def served(model: str) -> None:
        if model not in settings.models:
            raise NotServed(f"model: '{model}' is not served here (served: {', '.join(settings.models) or 'none'})",
                            param="model", code="model_not_found")

    @api.get("/v1/models")
    def list_models() -> ModelList:
        """The models this service serves, as OpenAI lists them."""
        return ModelList(data=[ModelCard(id=m) for m in settings.models])

    async def streamed(job: CompletionJob, chunk) -> StreamingResponse:
        """Server-sent events of the job's growing text, each event sent as its tokens are drawn; the response
        starts only once the job was accepted (a bad request is an error status, not a stream)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        job.on_text = lambda row, text: loop.call_soon_threadsafe(queue.put_nowait, (row, text))
        task = asyncio.ensure_future(run_batch(job))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        first = await queue.get()
        if first is None:
            answer_or_raise(task.result())  # raises the job's error (an error status), or it answered with no token

        async def events() -> AsyncIterator[str]:
            sent: dict[int, str] = {}
            stopped: set[int] = set()
            item = first
            while item is not None:
                row, text = item
                if row not in stopped and not text.endswith("\ufffd"):
                    cut, hit = cut_at_stop(text, job.stops)
                    if hit:
                        stopped.add(row)
                    if len(cut) > len(sent.get(row, "")):
                        yield _sse(chunk(row, cut[len(sent.get(row, "")):], None))
                        sent[row] = cut
                item = await queue.get()
            try:
                result = answer_or_raise(task.result())
            except PoolBenchError as exc:  # after the 200 went out: the error is the stream's last event
                yield _sse(openai_error(500, str(exc).splitlines()[0], param=getattr(exc, "param", None),
                                        code=getattr(exc, "code", None))[1])
                return
            for row, r in enumerate(result.rows):
                rest = r.text[len(sent.get(row, "")):] if r.text.startswith(sent.get(row, "")) else ""
                yield _sse(chunk(row, rest, r.finish_reason))
            if job.include_usage:
                yield _sse({**chunk(0, "", None), "choices": [], "usage": _usage(result.rows).model_dump()})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        """Text completions (OpenAI's legacy API): echo + logprobs with max_tokens 0 score a text, as
        lm-evaluation-harness's log-likelihood tasks ask; `steering` steers every prompt."""
        served(req.model)
        prompt = req.prompt
        texts = [prompt] if isinstance(prompt, str) else prompt if prompt and isinstance(prompt[0], str) else None
        ids = None if texts is not None else [prompt] if isinstance(prompt[0], int) else prompt
        job = CompletionJob(model=req.model, texts=texts, ids=ids, max_tokens=req.max_tokens,  # type: ignore[arg-type]
                            temperature=req.temperature, seed=req.seed or 0,
                            steering=request_steering(req.steering, request), logprobs=req.logprobs, echo=req.echo,
                            stops=req.stops)
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            job.include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunk(row: int, text: str, finish: str | None) -> dict:
                return {"id": ident, "object": "text_completion", "created": created, "model": req.model,
                        "choices": [{"index": row, "text": text, "logprobs": None, "finish_reason": finish}]}

            return await streamed(job, chunk)
        result: JobResult = answer_or_raise(await run_batch(job))
        return Completion(id=ident, created=created, model=req.model, usage=_usage(result.rows),
                          choices=[completion_choice(i, r, req.echo) for i, r in enumerate(result.rows)])

    @api.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        """Chat completions: the messages through the model's chat template; `steering` steers the answer."""
        served(req.model)
        job = CompletionJob(model=req.model, messages=[{"role": m.role, "content": m.text} for m in req.messages],
                            max_tokens=req.new_tokens or min(256, settings.max_new_tokens),
                            temperature=req.temperature, seed=req.seed or 0,
                            steering=request_steering(req.steering, request),
                            logprobs=(req.top_logprobs or 0) if req.logprobs else None, stops=req.stops)
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            job.include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunk(row: int, text: str, finish: str | None) -> dict:
                return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": req.model,
                        "choices": [{"index": row, "delta": {"role": "assistant", "content": text},
                                     "logprobs": None, "finish_reason": finish}]}

            return await streamed(job, chunk)
        result: JobResult = answer_or_raise(await run_batch(job))
        return ChatCompletion(id=ident, created=created, model=req.model, usage=_usage(result.rows), choices=[
            ChatChoice(index=i, message=AssistantMessage(content=r.text), finish_reason=r.finish_reason,  # type: ignore[arg-type]
                       logprobs=_chat_logprobs(r, req.top_logprobs or 0)) for i, r in enumerate(result.rows)])
