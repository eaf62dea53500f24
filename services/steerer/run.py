"""run_steering_cells: (concept, strategy, layer) cells of D2 and D3, from pooled vectors to records, several cells
through one generate call; run_steering is its one-cell case.

Three steps: each cell is prepared (its stored result read back, its null record stored, or its rows built: alpha
grid x prompts and the prompted baseline); the rows of every cell still to run go through ONE `generate_rows`, each
distinct row once (generation_rows.py), and one pass of the fluency guard's reference model over the distinct
continuations (fluency.py); then each cell is
finished (scores, relevance, D2, D3) and stored on its own. No Ray here: the pipeline calls it in-process or through
`SteeringService` (actor.py). Generations and the record are stored under a key of everything that determines them
(never how cells were grouped), so a rerun reads them back; a cell's generations go in first and its record last,
so a failed cell leaves no record behind.
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
from poolbench.scorer.shared_trunk import score_texts
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import artifact_key

from .backend import Generation, GenerationSettings
from .cell_steerability import stored_residual_norm
from .d2 import D2_VERSION, d2_summary, paired_delta, prompted_summary
from .d3 import D3_VERSION, d3_rep_flags, disentanglement, neighbours
from .errors import SteeringError
from .fluency import AUTO, DEFAULT_FLUENCY_GUARD, DEFAULT_MIN_DISTINCT, FLUENCY_MEASURE, distinct_rows
from .generation_rows import GenerationRow, distinct_by, generate_groups, group_slices
from .prompts import concept_instruction, load_prompts
from .vector import DEFAULT_ALPHAS, SteeringVector, cosine, diffmean_vector, validate_alphas
from .worker import SteeringWorker

STEERING_VERSION = 3  # 2: alpha's unit from the stored gradient sums where the extraction ran S2; 3: continuation NLLs
# in length-sorted chunks, the head on the scored positions only, logsumexp (float32 round-off moves)


@dataclass(frozen=True)
class SteeringConfig:
    """Every option of a steering cell; all of it enters the artefact key."""

    alphas: tuple[float, ...] = DEFAULT_ALPHAS
    n_prompts: int | None = 50
    prompts_file: str | None = None
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    fluency_guard: float = DEFAULT_FLUENCY_GUARD
    min_distinct: float = DEFAULT_MIN_DISTINCT
    reference_model: str = AUTO  # the model that judges fluency (fluency.reference_model_for)
    n_bootstrap: int = 1000
    seed: int = 0
    prompted_baseline: bool = True
    prompt_format: str = "auto"  # auto: the chat template's user turn when the tokenizer has one

    def to_record(self) -> dict:
        out = asdict(self)
        out["settings"] = self.settings.to_record()
        out["alphas"] = list(validate_alphas(self.alphas))
        return out

    def to_message(self) -> dict:
        """Every option, the batching ones that enter no key too, for an actor to rebuild this config exactly."""
        return {**self.to_record(), "settings": asdict(self.settings)}

    @classmethod
    def from_message(cls, message: dict) -> SteeringConfig:
        """The config `to_message` (or `to_record`, batching at its defaults) describes."""
        return cls(**{**message, "alphas": tuple(message.get("alphas", DEFAULT_ALPHAS)),
                      "settings": GenerationSettings(**message.get("settings", {}))})


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


@dataclass(frozen=True, eq=False)
class CellInputs:
    """One (concept, strategy, layer) cell and what it is computed from: its concept's pooled table, the train
    passages its alpha unit is measured on, the neighbours' pooled tables D3 compares vectors with, and the
    gradient sums S2's extraction stored at the layer (alpha's unit is read from them where they are given)."""

    concept: str
    strategy: str
    layer: int
    pooled_table: pa.Table
    train_texts: Sequence[str]
    neighbour_tables: Mapping[str, pa.Table] | None = None
    gradient_table: pa.Table | None = None


@dataclass(eq=False)
class PreparedCell:
    """A cell whose key, vector and generation rows are known, waiting for its generations."""

    cell: CellInputs
    key: str
    vector: SteeringVector
    prompts: list[str]
    seeds: list[int]
    base: dict
    d2: dict
    nbrs: dict[str, str]
    scorer_concepts: list[str]
    instruction: str
    reference: str  # the fluency guard's reference model, resolved
    rows: list[GenerationRow]
    seconds: float  # the cell's own time so far; its share of the shared generation is added when it finishes


def _check_config(config: SteeringConfig) -> tuple[tuple[float, ...], list[str]]:
    alphas = validate_alphas(config.alphas)
    prompts = load_prompts(config.prompts_file, config.n_prompts)
    if len(prompts) < 2:
        raise SteeringError(f"D2 needs at least 2 prompts, the prompts file gives {len(prompts)}")
    return alphas, prompts


def _check_cell(cell: CellInputs, scorers: Mapping[str, ScorerModel]) -> SteeringVector:
    """The cell's steering vector, or one line naming what is missing."""
    if cell.concept not in scorers:
        raise SteeringError(f"no scorer for concept '{cell.concept}' (have: {', '.join(sorted(scorers)) or 'none'})")
    if not cell.train_texts:
        raise SteeringError(f"concept '{cell.concept}': no train passages to measure the residual norm on")
    vector = steering_vector(PooledTableView(cell.pooled_table), cell.concept, cell.strategy, cell.layer)
    neighbours(cell.concept)
    return vector


def cell_rows(prompts: Sequence[str], seeds: Sequence[int], deltas: Sequence[np.ndarray | None], layer: int,
              prompted: Sequence[str]) -> list[GenerationRow]:
    """The alpha grid x prompts (alpha-major, a delta per alpha), then the prompted prompts, unsteered, each row
    with its prompt's seed, so a prompt's alphas and its prompted row are paired draws. `prompted` is one prompt per
    prompt, or empty when the run has no prompted baseline (then the rows are the alpha grid alone)."""
    if prompted and len(prompted) != len(prompts):
        raise SteeringError(f"the prompted baseline has {len(prompted)} prompts for {len(prompts)} steered ones")
    rows = [GenerationRow(p, d, s, layer) for d in deltas for p, s in zip(prompts, seeds, strict=True)]
    return rows + [GenerationRow(p, None, s, layer) for p, s in zip(prompted, seeds[:len(prompted)], strict=True)]


class AlphaUnits:
    """alpha's unit per (train passages, layer) for a group of cells. Where the cell carries its layer's stored
    gradient sums, the unit is read from them (cell_steerability.stored_residual_norm: no forward, and the same r_L
    first-order S uses); else measures.mean_residual_norms, measured when a cell first needs it at every layer the
    group's cells with the same train passages steer at: one forward to the deepest of them instead of one per
    layer. A cell read back from the store needs none."""

    def __init__(self, worker: SteeringWorker, cells: Sequence[CellInputs]) -> None:
        self._worker = worker
        self._layers: dict[str, set[int]] = {}
        for cell in cells:
            if cell.gradient_table is None:
                self._layers.setdefault(_digest(list(cell.train_texts)), set()).add(int(cell.layer))
        self._norms: dict[tuple[int, str], float] = {}

    def __call__(self, cell: CellInputs) -> float:
        if cell.gradient_table is not None:
            train = PooledTableView(cell.pooled_table).matrix(cell.layer, cell.strategy).subset("train")
            return stored_residual_norm(cell.gradient_table, train.passage_ids)
        texts = list(cell.train_texts)
        digest = _digest(texts)
        if (int(cell.layer), digest) not in self._norms:
            layers = sorted(self._layers.get(digest, set()) | {int(cell.layer)})
            for layer, norm in self._worker.residual_norms(texts, layers).items():
                self._norms[(int(layer), digest)] = norm
        return self._norms[(int(cell.layer), digest)]


def prepare_cell(store: ArtifactStore, worker: SteeringWorker, cell: CellInputs, vector: SteeringVector,
                 scorers: Mapping[str, ScorerModel], config: SteeringConfig, *, alphas: tuple[float, ...],
                 prompts: list[str], alpha_units: AlphaUnits) -> SteeringResult | PreparedCell:
    """The cell's stored result, its null result (stored now), or its rows to generate, from the vector, alphas and
    prompts run_steering_cells checked; `alpha_units` measures alpha's unit once for the cells of a group."""
    started = time.perf_counter()
    concept, strategy, layer = cell.concept, cell.strategy, cell.layer
    nbrs = neighbours(concept)
    info = worker.info()
    prompt_format = worker.prompt_format(config.prompt_format)
    base = {"concept": concept, "strategy": strategy, "layer": layer, "model_id": info["model_id"],
            "backend": info["backend"]}
    scorer = scorers[concept]
    scorer_concepts = [concept] + [c for c in nbrs.values() if c in scorers and c != concept]
    reference = worker.reference_name(config.reference_model)
    key = artifact_key(
        "steering", model=info["weights_hash"], dtype=info["dtype"], concept=concept, strategy=strategy,
        layer=layer, vector=_vector_digest(vector), raw_norm=round(vector.raw_norm, 6),
        prompts=_digest(prompts), train_texts=_digest(list(cell.train_texts)), config=config.to_record(),
        scorers={c: scorers[c].info.get("key", c) for c in scorer_concepts},
        backend=info["backend"], prompt_format=prompt_format, reference=reference,
        version=[STEERING_VERSION, D2_VERSION, D3_VERSION])
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

    vector = vector.with_residual_norm(alpha_units(cell))
    d2.update(residual_norm=vector.residual_norm)
    seeds = prompt_seeds(len(prompts), config.seed)
    instruction = concept_instruction(concept)
    deltas = [None if a == 0 else vector.delta(a) for a in alphas]
    prompted = [f"{instruction} {p}" for p in prompts] if config.prompted_baseline else []
    return PreparedCell(cell, key, vector, prompts, seeds, base, d2, nbrs, scorer_concepts, instruction, reference,
                        cell_rows(prompts, seeds, deltas, layer, prompted), time.perf_counter() - started)


def reference_nlls(worker: SteeringWorker, groups: Sequence[Sequence[Generation]], option: str = AUTO,
                   ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(summed NLL, tokens) per generation of each group under the fluency guard's reference model, each text
    alone (no prompt), from one pass over the distinct texts of all groups: steered and prompted continuations
    are judged alike, and every cell's alpha = 0 rows are the same texts."""
    distinct, index = distinct_by([g.text for group in groups for g in group], lambda text: text)
    nll, n_tok = worker.reference_nll(distinct, option) if distinct else (np.zeros(0), np.zeros(0, np.int64))
    picked = np.asarray(index, dtype=np.int64)
    return [(nll[picked[part]], n_tok[picked[part]]) for part in group_slices(groups)]


def finish_cell(store: ArtifactStore, worker: SteeringWorker, prepared: PreparedCell, gens: Sequence[Generation],
                all_nll: np.ndarray, all_tok: np.ndarray, scorers: Mapping[str, ScorerModel], config: SteeringConfig,
                *, shared_seconds: float = 0.0) -> SteeringResult:
    """Scores, relevance, D2 and D3 of a cell from its generations and their reference perplexities; stored (generations
    table first, record last). `shared_seconds` is the cell's share of the group's generation time."""
    started = time.perf_counter()
    cell, vector, prompts, seeds, d2 = prepared.cell, prepared.vector, prepared.prompts, prepared.seeds, prepared.d2
    concept, strategy, layer = cell.concept, cell.strategy, cell.layer
    alphas = validate_alphas(config.alphas)
    scorer = scorers[concept]
    n_a, n = len(alphas), len(prompts)
    flat = list(gens)
    gens_by_alpha = [flat[i * n:(i + 1) * n] for i in range(n_a)]
    pgens = flat[n_a * n:]
    texts = [g.text for row in gens_by_alpha for g in row]
    scores = {c: p.reshape(n_a, n) for c, p in score_texts({c: scorers[c] for c in prepared.scorer_concepts},
                                                             texts).items()}
    nll, n_tok = all_nll[:n_a * n].reshape(n_a, n), all_tok[:n_a * n].reshape(n_a, n)
    relevance = worker.relevance([g.prompt for row in gens_by_alpha for g in row], texts).reshape(n_a, n)
    distinct = distinct_rows(texts).reshape(n_a, n)
    summary = d2_summary(alphas, scores[concept], nll, n_tok, relevance, guard=config.fluency_guard,
                         n_bootstrap=config.n_bootstrap, seed=config.seed, distinct=distinct,
                         min_distinct=config.min_distinct)
    report = np.asarray(summary["report_prompts"])
    d2.update(status="ok", null_reason=None, **summary, reference_model=prepared.reference,
              fluency_measure=FLUENCY_MEASURE)
    tables = [_generations_table(alphas, gens_by_alpha, seeds, scores, "steered")]

    if config.prompted_baseline:
        p_scores = scorer.score([g.text for g in pgens])
        p_nll, p_tok = all_nll[n_a * n:], all_tok[n_a * n:]
        p_rel = worker.relevance(prompts, [g.text for g in pgens])
        d2.update(prompted_instruction=prepared.instruction,
                  **prompted_summary(p_scores, p_nll, p_tok, p_rel, scores[concept][0], nll[0], n_tok[0],
                                     report, n_bootstrap=config.n_bootstrap, seed=config.seed,
                                     guard=config.fluency_guard, distinct_p=distinct_rows([g.text for g in pgens]),
                                     min_distinct=config.min_distinct))
        tables.append(_generations_table([0.0], [pgens], seeds, {concept: p_scores}, "prompted"))

    star = summary["alpha_star_index"]
    delta_a = paired_delta(scores[concept][star, report], scores[concept][0, report],
                           n_bootstrap=config.n_bootstrap, seed=config.seed)
    d3 = []
    for rel, other in prepared.nbrs.items():
        rec = {**prepared.base, "neighbour": other, "relation": rel, "alpha_star": summary["alpha_star"],
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
        other_table = (cell.neighbour_tables or {}).get(other)
        if other_table is not None:
            other_vec = steering_vector(PooledTableView(other_table), other, strategy, layer)
            rec.update(d3_rep=cosine(vector.direction, other_vec.direction),
                       neighbour_vector_null_reason=other_vec.null_reason,
                       **d3_rep_flags(vector.direction, other_vec.direction))
        else:
            rec.update(d3_rep=None, neighbour_vector_null_reason="neighbour's pooled table not given")
        d3.append(D3Record(**rec))

    d2["seconds"] = round(prepared.seconds + shared_seconds + time.perf_counter() - started, 3)
    gens_key = prepared.key.replace("steering/", "generations/", 1)
    store.put_table(gens_key, pa.concat_tables(tables, promote_options="default"),
                    metadata={"concept": concept, "strategy": strategy, "layer": str(layer)})
    d2["generations_key"] = gens_key
    result = SteeringResult(d2=D2Record(**d2), d3=d3, key=prepared.key)
    store.put_json(prepared.key, result.to_dict())
    return result


def run_steering_cells(store: ArtifactStore, worker: SteeringWorker, cells: Sequence[CellInputs],
                       scorers: Mapping[str, ScorerModel], config: SteeringConfig) -> list[SteeringResult]:
    """Each cell's D2 record and a D3 record per neighbour, in cell order; stored cells are read back, and the
    rest generate in one call. Every cell is checked before anything generates."""
    alphas, prompts = _check_config(config)
    vectors = [_check_cell(cell, scorers) for cell in cells]
    units = AlphaUnits(worker, cells)
    ready = [prepare_cell(store, worker, cell, vector, scorers, config, alphas=alphas, prompts=prompts,
                          alpha_units=units) for cell, vector in zip(cells, vectors, strict=True)]
    todo = [c for c in ready if isinstance(c, PreparedCell)]
    if todo:
        started = time.perf_counter()
        prompt_format = worker.prompt_format(config.prompt_format)
        gens = generate_groups(worker, [c.rows for c in todo], config.settings, prompt_format)
        nlls = reference_nlls(worker, gens, config.reference_model)
        shared = time.perf_counter() - started
        total = sum(len(c.rows) for c in todo)
        finished = iter([finish_cell(store, worker, c, g, nll, n_tok, scorers, config,
                                     shared_seconds=shared * len(c.rows) / total)
                         for c, g, (nll, n_tok) in zip(todo, gens, nlls, strict=True)])
        ready = [next(finished) if isinstance(c, PreparedCell) else c for c in ready]
    return [r for r in ready if isinstance(r, SteeringResult)]


def run_steering(store: ArtifactStore, worker: SteeringWorker, concept: str, strategy: str, layer: int,
                 pooled_table: pa.Table, scorers: Mapping[str, ScorerModel], config: SteeringConfig, *,
                 train_texts: Sequence[str], neighbour_tables: Mapping[str, pa.Table] | None = None
                 ) -> SteeringResult:
    """The cell's D2 record and a D3 record per neighbour; stored, and read back on a rerun."""
    cell = CellInputs(concept, strategy, layer, pooled_table, train_texts, neighbour_tables)
    return run_steering_cells(store, worker, [cell], scorers, config)[0]
