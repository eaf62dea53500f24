"""run_steering: one (concept, strategy, layer) cell of D2 and D3, from pooled vectors to records.

No Ray here: the pipeline calls it in-process or through `SteeringActor` (actor.py). Generations and the
record are stored under a key of everything that determines them, so a rerun reads them back; the
generations go in first and the record last, so a failed cell leaves no record behind.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa

from poolbench.pooler.pooled_table import PooledTableView
from poolbench.records.steering import D2Record, D3Record, SteeringResult
from poolbench.scorer.scorer_model import ScorerModel
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import artifact_key

from .backend import Generation, GenerationSettings
from .d2 import D2_VERSION, DEFAULT_FLUENCY_GUARD, d2_summary, paired_delta, prompted_summary
from .d3 import D3_VERSION, d3_rep_flags, disentanglement, neighbours
from .errors import SteeringError
from .prompts import concept_instruction, load_prompts
from .vector import DEFAULT_ALPHAS, SteeringVector, cosine, diffmean_vector, validate_alphas
from .worker import SteeringWorker

STEERING_VERSION = 1


@dataclass(frozen=True)
class SteeringConfig:
    """Every option of a steering cell; all of it enters the artefact key."""

    alphas: tuple[float, ...] = DEFAULT_ALPHAS
    n_prompts: int | None = 50
    prompts_file: str | None = None
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    fluency_guard: float = DEFAULT_FLUENCY_GUARD
    n_bootstrap: int = 1000
    seed: int = 0
    prompted_baseline: bool = True
    prompt_format: str = "auto"  # auto: the chat template's user turn when the tokenizer has one

    def to_record(self) -> dict:
        out = asdict(self)
        out["settings"] = self.settings.to_record()
        out["alphas"] = list(validate_alphas(self.alphas))
        return out


def prompt_seeds(n: int, seed: int) -> list[int]:
    """One sampling seed per prompt, the same at every alpha, so each prompt's alphas are paired draws."""
    return [seed * 1_000_003 + i for i in range(n)]


def steering_vector(view: PooledTableView, concept: str, strategy: str, layer: int) -> SteeringVector:
    if (layer, strategy) not in set(view.cells):
        strategies = sorted({s for _, s in view.cells})
        layers = sorted({L for L, _ in view.cells})
        raise SteeringError(f"concept '{concept}': no pooled cell (layer {layer}, strategy '{strategy}'); "
                            f"table has strategies {strategies} at layers {layers}")
    train = view.matrix(layer, strategy).subset("train")
    return diffmean_vector(train.X, train.y, concept=concept, strategy=strategy, layer=layer)


def _digest(values: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(values).encode()).hexdigest()[:16]


def _vector_digest(vector: SteeringVector) -> str:
    data = b"" if vector.direction is None else np.ascontiguousarray(vector.direction).tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def _generations_table(alphas: Sequence[float], gens: Sequence[Sequence[Generation]], seeds: Sequence[int],
                       scores: Mapping[str, np.ndarray], kind: str) -> pa.Table:
    rows = {"kind": [], "alpha": [], "prompt_index": [], "seed": [], "prompt": [], "text": [], "n_tokens": []}
    for a, row in zip(alphas, gens, strict=True):
        for i, g in enumerate(row):
            for col, v in (("kind", kind), ("alpha", float(a)), ("prompt_index", i), ("seed", seeds[i]),
                           ("prompt", g.prompt), ("text", g.text), ("n_tokens", len(g.token_ids))):
                rows[col].append(v)
    cols = {k: pa.array(v) for k, v in rows.items()}
    for concept, s in scores.items():
        cols[f"score_{concept}"] = pa.array(np.asarray(s, dtype=np.float64).reshape(-1))
    return pa.table(cols)


def run_steering(store: ArtifactStore, worker: SteeringWorker, concept: str, strategy: str, layer: int,
                 pooled_table: pa.Table, scorers: Mapping[str, ScorerModel], config: SteeringConfig, *,
                 train_texts: Sequence[str], neighbour_tables: Mapping[str, pa.Table] | None = None
                 ) -> SteeringResult:
    """The cell's D2 record and a D3 record per neighbour; stored, and read back on a rerun."""
    started = time.perf_counter()
    alphas = validate_alphas(config.alphas)
    if concept not in scorers:
        raise SteeringError(f"no scorer for concept '{concept}' (have: {', '.join(sorted(scorers)) or 'none'})")
    prompts = load_prompts(config.prompts_file, config.n_prompts)
    if len(prompts) < 2:
        raise SteeringError(f"D2 needs at least 2 prompts, the prompts file gives {len(prompts)}")
    if not train_texts:
        raise SteeringError(f"concept '{concept}': no train passages to measure the residual norm on")
    view = PooledTableView(pooled_table)
    vector = steering_vector(view, concept, strategy, layer)
    nbrs = neighbours(concept)
    info = worker.info()
    prompt_format = worker.prompt_format(config.prompt_format)
    base = {"concept": concept, "strategy": strategy, "layer": layer, "model_id": info["model_id"],
            "backend": info["backend"]}
    scorer = scorers[concept]
    scorer_concepts = [concept] + [c for c in nbrs.values() if c in scorers and c != concept]
    key = artifact_key(
        "steering", model=info["weights_hash"], dtype=info["dtype"], concept=concept, strategy=strategy,
        layer=layer, vector=_vector_digest(vector), raw_norm=round(vector.raw_norm, 6),
        prompts=_digest(prompts), train_texts=_digest(list(train_texts)), config=config.to_record(),
        scorers={c: scorers[c].info.get("key", c) for c in scorer_concepts},
        backend=info["backend"], prompt_format=prompt_format, version=[STEERING_VERSION, D2_VERSION, D3_VERSION])
    if store.exists(key):
        return SteeringResult.from_dict(store.get_json(key))

    d2: dict = {**base, **vector.to_record(), "n_prompts": len(prompts), "alphas": list(alphas),
                "scorer_key": scorer.info.get("key"), "scorer_heldout_auroc": scorer.info.get("heldout_auroc"),
                "prompt_format": prompt_format,
                **{f"gen_{k}": v for k, v in config.settings.to_record().items()}}
    if vector.is_null:
        d2.update(status="null", null_reason=vector.null_reason, scp=None, d2_delta=None)
        d3 = [D3Record(**base, neighbour=c, relation=rel, disent=None, disent_raw=None,
                       disent_null_reason=f"steering vector is null: {vector.null_reason}", d3_rep=None)
              for rel, c in nbrs.items()]
        result = SteeringResult(d2=D2Record(**d2), d3=d3, key=key)
        store.put_json(key, result.to_dict())
        return result

    vector = vector.with_residual_norm(worker.residual_norm(list(train_texts), layer))
    d2.update(residual_norm=vector.residual_norm)
    seeds = prompt_seeds(len(prompts), config.seed)
    n_a, n = len(alphas), len(prompts)
    instruction = concept_instruction(concept)
    # The whole alpha grid x prompts (and the prompted baseline's prompts, unsteered) in shared batches: each
    # row carries its own delta and seed, and a prompt's alpha rows share one batch, so they differ only by the
    # delta, on identical sampling noise (paired draws; transformers_backend.py says what holds across batches).
    deltas = [None if a == 0 else vector.delta(a) for a in alphas]
    rows = [p for _ in alphas for p in prompts]
    row_deltas = [d for d in deltas for _ in prompts]
    if config.prompted_baseline:
        rows += [f"{instruction} {p}" for p in prompts]
        row_deltas += [None] * n
    flat = worker.generate_rows(rows, layer=layer, deltas=row_deltas, seeds=seeds * (len(rows) // n),
                                settings=config.settings, prompt_format=prompt_format)
    gens = [flat[i * n:(i + 1) * n] for i in range(n_a)]
    pgens = flat[n_a * n:]
    # Perplexity of the prompted continuation is measured given the neutral prompt, as for steering.
    as_neutral = [Generation(g0.prompt, gp.text, g0.prompt_ids, gp.token_ids)
                  for g0, gp in zip(gens[0], pgens, strict=True)] if pgens else []
    all_nll, all_tok = worker.nll([g for row in gens for g in row] + as_neutral)
    texts = [g.text for row in gens for g in row]
    scores = {c: scorers[c].score(texts).reshape(n_a, n) for c in scorer_concepts}
    nll, n_tok = all_nll[:n_a * n].reshape(n_a, n), all_tok[:n_a * n].reshape(n_a, n)
    relevance = worker.relevance([g.prompt for row in gens for g in row], texts).reshape(n_a, n)
    summary = d2_summary(alphas, scores[concept], nll, n_tok, relevance, guard=config.fluency_guard,
                         n_bootstrap=config.n_bootstrap, seed=config.seed)
    report = np.asarray(summary["report_prompts"])
    d2.update(status="ok", null_reason=None, **summary)
    tables = [_generations_table(alphas, gens, seeds, scores, "steered")]

    if config.prompted_baseline:
        p_scores = scorer.score([g.text for g in pgens])
        p_nll, p_tok = all_nll[n_a * n:], all_tok[n_a * n:]
        p_rel = worker.relevance(prompts, [g.text for g in pgens])
        d2.update(prompted_instruction=instruction,
                  **prompted_summary(p_scores, p_nll, p_tok, p_rel, scores[concept][0], nll[0], n_tok[0],
                                     report, n_bootstrap=config.n_bootstrap, seed=config.seed,
                                     guard=config.fluency_guard))
        tables.append(_generations_table([0.0], [pgens], seeds, {concept: p_scores}, "prompted"))

    star = summary["alpha_star_index"]
    delta_a = paired_delta(scores[concept][star, report], scores[concept][0, report],
                           n_bootstrap=config.n_bootstrap, seed=config.seed)
    d3 = []
    for rel, other in nbrs.items():
        rec = {**base, "neighbour": other, "relation": rel, "alpha_star": summary["alpha_star"],
               "delta_a": delta_a["delta"], "delta_a_ci_low": delta_a["ci_low"],
               "delta_a_ci_high": delta_a["ci_high"]}
        if other in scores:
            delta_b = paired_delta(scores[other][star, report], scores[other][0, report],
                                   n_bootstrap=config.n_bootstrap, seed=config.seed)
            rec.update(delta_b=delta_b["delta"], delta_b_ci_low=delta_b["ci_low"],
                       delta_b_ci_high=delta_b["ci_high"],
                       **disentanglement(delta_a["delta"], (delta_a["ci_low"], delta_a["ci_high"]),
                                         delta_b["delta"]))
        else:
            rec.update(delta_b=None, disent=None, disent_raw=None,
                       disent_null_reason=f"no scorer for neighbour '{other}'")
        other_table = (neighbour_tables or {}).get(other)
        if other_table is not None:
            other_vec = steering_vector(PooledTableView(other_table), other, strategy, layer)
            rec.update(d3_rep=cosine(vector.direction, other_vec.direction),
                       neighbour_vector_null_reason=other_vec.null_reason,
                       **d3_rep_flags(vector.direction, other_vec.direction))
        else:
            rec.update(d3_rep=None, neighbour_vector_null_reason="neighbour's pooled table not given")
        d3.append(D3Record(**rec))

    d2["seconds"] = round(time.perf_counter() - started, 3)
    gens_key = key.replace("steering/", "generations/", 1)
    store.put_table(gens_key, pa.concat_tables(tables, promote_options="default"),
                    metadata={"concept": concept, "strategy": strategy, "layer": str(layer)})
    d2["generations_key"] = gens_key
    result = SteeringResult(d2=D2Record(**d2), d3=d3, key=key)
    store.put_json(key, result.to_dict())
    return result
