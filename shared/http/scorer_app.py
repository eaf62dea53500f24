"""Ray Serve app: `POST /score {concept, texts}` -> probabilities, and, when a model is configured,
`POST /generate {model, concept, strategy, layer, alpha, prompts}` -> steered continuations.

Bound to 127.0.0.1 unless a host is given. Scorers and pooled tables are read from the artifact store by
key (never pickled); a scorer is loaded on first use and kept. No `from __future__ import annotations`:
FastAPI must see the request models as classes to read them from the JSON body.
"""


from collections.abc import Mapping

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field
from ray import serve

from poolbench.errors import PoolBenchError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
MAX_TEXTS = 1024

api = FastAPI(title="PoolBench scorer")


class ScoreRequest(BaseModel):
    concept: str
    texts: list[str] = Field(max_length=MAX_TEXTS)


class GenerateRequest(BaseModel):
    model: str
    concept: str
    strategy: str
    layer: int
    alpha: float = Field(ge=0)
    prompts: list[str] = Field(min_length=1, max_length=256)
    max_new_tokens: int = Field(32, ge=1, le=512)
    greedy: bool = False
    seed: int = 0


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 1})
@serve.ingress(api)
class PoolBenchService:
    def __init__(self, store_url: str, scorer_keys: Mapping[str, str], model: str | None = None,
                 pooled_keys: Mapping[str, str] | None = None) -> None:
        from poolbench.store.url import open_store

        self.store = open_store(store_url)
        self.scorer_keys = dict(scorer_keys)
        self.pooled_keys = dict(pooled_keys or {})
        self.model = model
        self._scorers: dict = {}
        self._worker = None

    def _scorer(self, concept: str):
        from poolbench.scorer.artifacts import load_stored_scorer

        if concept not in self.scorer_keys:
            raise HTTPException(404, f"no scorer for concept '{concept}' (have: {', '.join(sorted(self.scorer_keys))})")
        if concept not in self._scorers:
            self._scorers[concept] = load_stored_scorer(self.store, self.scorer_keys[concept], concept)
        return self._scorers[concept]

    @api.post("/score")
    def score(self, req: ScoreRequest) -> dict:
        try:
            probs = self._scorer(req.concept).score(req.texts) if req.texts else []
        except PoolBenchError as exc:
            raise HTTPException(500, str(exc)) from exc
        return {"concept": req.concept, "probabilities": [float(p) for p in probs]}

    @api.post("/generate")
    def generate(self, req: GenerateRequest) -> dict:
        from poolbench.pooler.pooled_table import PooledTableView
        from poolbench.steerer.backend import GenerationSettings
        from poolbench.steerer.run import prompt_seeds, steering_vector
        from poolbench.steerer.worker import SteeringWorker

        if self.model is None or req.model != self.model:
            raise HTTPException(404, f"this service steers model '{self.model}', not '{req.model}'")
        if req.concept not in self.pooled_keys:
            raise HTTPException(404, f"no pooled vectors for concept '{req.concept}'")
        try:
            if self._worker is None:
                self._worker = SteeringWorker(self.model)
            vector = steering_vector(PooledTableView(self.store.get_table(self.pooled_keys[req.concept])),
                                     req.concept, req.strategy, req.layer)
            if vector.is_null:
                raise HTTPException(422, f"steering vector is null: {vector.null_reason}")
            delta = None
            if req.alpha > 0:
                norm = self._worker.residual_norm(req.prompts, req.layer)
                delta = vector.with_residual_norm(norm).delta(req.alpha)
            gens = self._worker.generate(req.prompts, layer=req.layer, delta=delta,
                                         seeds=prompt_seeds(len(req.prompts), req.seed),
                                         settings=GenerationSettings(max_new_tokens=req.max_new_tokens,
                                                                     greedy=req.greedy))
        except PoolBenchError as exc:
            raise HTTPException(400, str(exc)) from exc
        return {"continuations": [g.text for g in gens]}


def start_service(store_url: str, scorer_keys: Mapping[str, str], *, host: str = DEFAULT_HOST,
                  port: int = DEFAULT_PORT, model: str | None = None,
                  pooled_keys: Mapping[str, str] | None = None) -> str:
    """Start Serve on host:port (127.0.0.1 by default) and deploy the app at '/'; returns its base URL."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(PoolBenchService.bind(store_url, dict(scorer_keys), model, dict(pooled_keys or {})),
              name="poolbench", route_prefix="/")
    return f"http://{host}:{port}"
