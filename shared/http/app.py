"""PoolBench over HTTP: the one Ray Serve application, a FastAPI ingress with /pool, /probe, /score, /generate.

Routes are thin: they validate (pydantic, size limits, finite numbers, a body limit counted while streaming)
and hand the request to its handler (poolbench.http.handlers), which calls the functions the batch pipeline uses
(pool_concept, probe_pooled_table, ScorerModel, TransformersBackend). Requests run concurrently in a replica's
threads; each use of a loaded model (LM or scorer) holds that model's lock, because a model carries shared state
besides hooks (the fast tokenizer's padding/truncation settings, the attention implementation S1 swaps in) and
one CPU forward already uses every core. Hooks are request-local as well (poolbench.extractor.hook_points);
/probe's statistics run outside the lock.
"""

from __future__ import annotations

import asyncio
import os

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from poolbench.compute_thread import ComputeThread
from poolbench.errors import PoolBenchError
from poolbench.http.access import TOKEN_ENV, bearer_ok, check_exposure, with_token
from poolbench.http.admission import Admission
from poolbench.http.batching import answer_or_raise, batched
from poolbench.http.body_limit import BodyLimit
from poolbench.http.handlers import check_sizes, generate_many, pool_many, probe_one, score_many
from poolbench.http.leaderboard_route import add_leaderboard_route
from poolbench.http.model_caches import ModelCache, ScorerCache, SteeringEngines, VectorCache
from poolbench.http.openai_errors import busy_refusal, is_openai_path, openai_error, param_of, too_large_refusal
from poolbench.http.openai_routes import add_openai_routes
from poolbench.http.openapi_limits import limits_description, merge_keywords, schema_limits
from poolbench.http.schemas import (
    GenerateRequest,
    GenerateResponse,
    Health,
    PoolRequest,
    PoolResponse,
    ProbeRequest,
    ProbeResponse,
    ScoreRequest,
    ScoreResponse,
)
from poolbench.http.service_errors import NotServed, RequestError, ServiceConfigError
from poolbench.http.settings import ServiceSettings, check_scorers
from poolbench.http.text_pooling import strategy_spec
from poolbench.steerer.errors import EngineDied

APP_NAME = "poolbench"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
OPEN_PATHS = ("/healthz",)  # answered without the bearer token: liveness checks carry no secret


def _one_line_validation(errors: list[dict]) -> str:
    """The first few pydantic errors as 'loc: message' in one line (a body that is no JSON says where it breaks)."""
    parts = []
    for err in errors[:3]:
        if err.get("type") == "json_invalid":
            at = err.get("loc", ("body", "?"))[-1]
            parts.append(f"body: not valid JSON at character {at} ({(err.get('ctx') or {}).get('error', 'invalid')})")
            continue
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc and not msg.startswith(f"{loc}:") else msg)
    more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more


def _validation_param(errors: list[dict]) -> str | None:
    """The field the first validation error names (OpenAI's `param`), None for a body that is no JSON."""
    if not errors or errors[0].get("type") == "json_invalid":
        return None
    loc = ".".join(str(p) for p in errors[0].get("loc", ()) if p != "body")
    return loc or param_of(str(errors[0].get("msg", "")).removeprefix("Value error, "))


def error_response(request: Request, status: int, message: str, headers: dict | None = None,
                   extra: dict | None = None, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    """{"detail": message} (PoolBench's routes), or OpenAI's {"error": {...}} on /v1/ paths (openai_errors), where
    a request the service cannot serve as asked is a 400 as OpenAI's clients expect."""
    if is_openai_path(request.url.path):
        status, content = openai_error(status, message, param=param, code=code)
        return JSONResponse(status_code=status, headers=headers, content=content)
    return JSONResponse(status_code=status, headers=headers, content={"detail": message, **(extra or {})})


def _service_error(request: Request, status: int, exc: PoolBenchError) -> JSONResponse:
    return error_response(request, status, str(exc).splitlines()[0], param=getattr(exc, "param", None),
                          code=getattr(exc, "code", None))


_ERRORS = {404: {"description": "model or scorer not served here"},
           413: {"description": "request body over max_body_bytes"},
           422: {"description": "invalid request (one-line detail)"}}


def build_api(settings: ServiceSettings) -> FastAPI:
    """The FastAPI app (usable without Ray: tests and `uvicorn` can mount it directly)."""
    api = FastAPI(title="PoolBench", version="1", description=limits_description(settings))
    api.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, refusal=too_large_refusal)
    api.add_middleware(Admission, workers=settings.max_working, queue=settings.max_queued, open_paths=OPEN_PATHS,
                       refusal=busy_refusal)
    if settings.token is not None:
        token = settings.token

        @api.middleware("http")
        async def require_token(request: Request, call_next):  # added last: runs before the body is read
            if request.url.path in OPEN_PATHS or bearer_ok(request.headers.get("authorization"), token):
                return await call_next(request)
            return error_response(request, 401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"},
                                  code="invalid_api_key")
    models = ModelCache(settings)
    engines = SteeringEngines(settings)
    # Every model call of this app on one thread (poolbench.compute_thread): request threads would each give
    # libgomp a team of OpenMP threads and throttle them all.
    compute = ComputeThread("poolbench-http")
    scorers = ScorerCache(settings)
    vectors = VectorCache(settings)
    plain_openapi = api.openapi

    def openapi_with_limits() -> dict:
        if api.openapi_schema is None:
            schemas = plain_openapi()["components"]["schemas"]
            for model, fields in schema_limits(settings).items():
                for name, keywords in fields.items():
                    merge_keywords(schemas[model]["properties"][name], keywords)
        return api.openapi_schema

    api.openapi = openapi_with_limits  # type: ignore[method-assign]

    @api.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        return error_response(request, 422, _one_line_validation(errors), param=_validation_param(errors), extra={
            "errors": [{"loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in errors]})

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        """Starlette's own errors (no such route, wrong method, a body over the limit while streaming): OpenAI's
        shape on /v1/, FastAPI's {"detail"} elsewhere."""
        if not is_openai_path(request.url.path):
            return await http_exception_handler(request, exc)
        code = {404: "unknown_url", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return error_response(request, exc.status_code, str(exc.detail), dict(exc.headers or {}), code=code)

    @api.exception_handler(NotServed)
    async def not_served(request: Request, exc: NotServed):
        return _service_error(request, 404, exc)

    @api.exception_handler(ServiceConfigError)
    async def unavailable(request: Request, exc: ServiceConfigError):
        return _service_error(request, 503, exc)

    @api.exception_handler(EngineDied)
    async def engine_died(request: Request, exc: EngineDied):
        return error_response(request, 503, str(exc).splitlines()[0])

    @api.exception_handler(PoolBenchError)
    async def poolbench_error(request: Request, exc: PoolBenchError):
        return _service_error(request, 422, exc)

    add_leaderboard_route(api, settings.leaderboard)

    @api.get("/healthz")
    def healthz() -> Health:
        return Health(status="ok", models=list(settings.models), scorers=settings.scorer_concepts,
                      vectors=sorted(settings.pooled_keys))

    pool_batched = batched(lambda reqs: pool_many(reqs, settings=settings, models=models), settings, compute)
    score_batched = batched(lambda reqs: score_many(reqs, scorers=scorers), settings, compute)
    generate_batched = batched(lambda reqs: generate_many(reqs, models=models, engines=engines, vectors=vectors),
                               settings, compute)

    @api.post("/pool", responses=_ERRORS)
    async def pool(req: PoolRequest) -> PoolResponse:
        """Pooled vectors of `texts` at one layer with one strategy, in input order (served in a batch with the
        /pool requests waiting with it; the answer is the same as alone)."""
        check_sizes(settings, req.texts, "texts")
        spec = strategy_spec(req.strategy)
        if spec.supervision != "none" or "corpus" in spec.needs:
            raise RequestError(f"strategy: {spec.id} needs labels or corpus statistics; use /probe or a run")
        return answer_or_raise(await pool_batched(req))

    @api.post("/probe", responses=_ERRORS)
    async def probe(req: ProbeRequest) -> ProbeResponse:
        """D1 of one cell on labelled texts: grouped CV AUROC on train, held-out AUROC with a bootstrap CI."""
        return await asyncio.wrap_future(compute.submit(probe_one, req, settings=settings, models=models))

    @api.post("/score", responses=_ERRORS)
    async def score(req: ScoreRequest) -> ScoreResponse:
        """Classifier B's P(concept | text) for each text, from the scorer configured (or run-recorded) for it
        (served in a batch with the /score requests waiting with it; the answer is the same as alone)."""
        check_sizes(settings, req.texts, "texts")
        return answer_or_raise(await score_batched(req))

    @api.post("/generate", responses=_ERRORS)
    async def generate(req: GenerateRequest) -> GenerateResponse:
        """Continuations with alpha * vector added to the output of `layer` (the steerer's backend); the /generate
        requests waiting together share one engine call, each row with its own vector, layer and seed (the answer
        is the same as alone)."""
        check_sizes(settings, req.prompts, "prompts")
        if req.max_new_tokens > settings.max_new_tokens:
            raise RequestError(f"max_new_tokens: {req.max_new_tokens}, at most {settings.max_new_tokens}")
        return answer_or_raise(await generate_batched(req))

    add_openai_routes(api, settings, compute, models=models, engines=engines, vectors=vectors)
    return api


def serve_application(settings: ServiceSettings, *, num_cpus: float = 1.0):
    """The Serve application: one deployment whose ingress is the FastAPI app, built on each replica."""
    import ray
    from ray import serve

    def build() -> FastAPI:
        return build_api(settings)

    # Serve forwards every request (a waiting one costs the replica an asyncio task); Admission decides who waits.
    ongoing = 2 * (settings.max_working + settings.max_queued) + 16

    @serve.deployment(name="PoolBenchIngress", num_replicas=1, max_ongoing_requests=ongoing,
                      ray_actor_options={"num_cpus": num_cpus,
                                         **({"num_gpus": 1} if settings.steering_backend == "vllm"
                                            and ray.cluster_resources().get("GPU") else {})})
    @serve.ingress(build)
    class PoolBenchIngress:
        """Holds one replica's models and scorers; every route is the FastAPI handler."""

    return PoolBenchIngress.bind()


def start_serve(settings: ServiceSettings, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                num_cpus: float = 1.0) -> str:
    """Start Serve's HTTP proxy on host:port (Ray must be connected) and deploy; returns the base URL."""
    from ray import serve

    settings = with_token(settings, settings.token or os.environ.get(TOKEN_ENV) or None)
    check_exposure(host, settings.token)
    check_scorers(settings)
    serve.start(http_options={"host": host, "port": port})
    serve.run(serve_application(settings, num_cpus=num_cpus), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{host}:{port}"
