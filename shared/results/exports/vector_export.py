"""A run's steering vector taken out of the store, in the units the steering backends add, with its provenance.

The vector is the cell's DiffMean direction (steerer.run.steering_vector, the one D2 and /generate steer with)
times the layer's residual norm: the delta the transformers and vLLM backends add at alpha = 1
(steerer.vector.SteeringVector.delta). A client that adds `alpha * tensor` at the same block's output therefore
steers as PoolBench did at that alpha. Where the run measured no residual norm (no D2 cell at that concept and
layer), `unit="raw"` gives the DiffMean at its own length instead; it is refused otherwise, never guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from poolbench.errors import PoolBenchError

Unit = Literal["residual", "raw"]
RESIDUAL_SITES = ("residual", "out")  # a block's output, what `layers.{L}.out` hooks and control vectors add to


class ExportError(PoolBenchError):
    """A vector the run does not hold, or one the chosen format cannot express."""


@dataclass(frozen=True)
class ExportedVector:
    """One layer's vector at alpha = 1 (float32 [d]) and the metadata every format carries beside it."""

    concept: str
    strategy: str
    layer: int
    site: str
    vector: np.ndarray
    metadata: dict[str, str | int | float]

    @property
    def hook_point(self) -> str:
        return f"layers.{self.layer}.out" if self.site in RESIDUAL_SITES else f"layers.{self.layer}.{self.site}"


def read_run(run: Path) -> dict:
    """A finished run folder's results.json, or one line saying why not."""
    path = Path(run) / "results.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ExportError(f"{path}: no such file ('{run}' is not a finished run folder)") from exc
    except json.JSONDecodeError as exc:
        raise ExportError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from exc


def _steered_cells(doc: dict, concept: str, strategy: str) -> list[dict]:
    return [r for r in doc.get("d2") or [] if r.get("concept") == concept and r.get("strategy") == strategy]


def choose_layer(doc: dict, run: Path, concept: str, strategy: str, layer: int | None) -> int:
    """`layer` as given, or the layer of the run's one D2 cell of (concept, strategy); one line when ambiguous."""
    if layer is not None:
        return layer
    layers = sorted({int(r["layer"]) for r in _steered_cells(doc, concept, strategy)})
    if len(layers) == 1:
        return layers[0]
    raise ExportError(f"--layer: {run} steered {concept}/{strategy} at "
                      f"{'layers ' + ', '.join(map(str, layers)) if layers else 'no layer'}; name one with --layer")


def _provenance(doc: dict, concept: str, strategy: str, layer: int, site: str) -> dict[str, str | int | float]:
    config = doc.get("config") or {}
    model = doc.get("model") or {}
    corpus = doc.get("corpus") or {}
    out: dict[str, str | int | float] = {
        "concept": concept, "strategy": strategy, "layer": layer, "site": site,
        "hook_point": f"layers.{layer}.out" if site in RESIDUAL_SITES else f"layers.{layer}.{site}",
        "model_id": str(model.get("model_id") or config.get("model") or ""),
        "model_weights_hash": str(model.get("weights_hash") or ""),
        "model_revision": str((config.get("model_args") or {}).get("revision") or ""),
        "corpus_hash": str(corpus.get("hash") or ""), "corpus": str(corpus.get("source") or config.get("corpus") or ""),
        "run_git_hash": str(doc.get("git_hash") or ""), "run_date": str(doc.get("date") or ""),
        "vector": "DiffMean of the run's pooled train vectors (mean positive - mean negative), steerer.run",
    }
    if model.get("hidden_size") is not None:
        out["hidden_size"] = int(model["hidden_size"])
    if model.get("n_layers") is not None:
        out["n_layers"] = int(model["n_layers"])
    return out


def _steering_metadata(cell: dict | None) -> dict[str, str | int | float]:
    """What the run's D2 cell measured: alpha*, its outcome, the fluency guard and ratio, Delta at alpha*."""
    if cell is None:
        return {"steered": 0}
    out: dict[str, str | int | float] = {"steered": 1}
    for key in ("alpha_star", "alpha_star_outcome", "fluency_guard", "fluency_ratio", "d2_delta", "scp",
                "backend", "prompt_format"):
        if cell.get(key) is not None:
            out[key] = cell[key]
    return out


def exported_vector(run: Path, concept: str, strategy: str, layer: int | None = None, *, unit: Unit = "residual",
                    ) -> ExportedVector:
    """The run's (concept, strategy, layer) vector at alpha = 1 in `unit`, with provenance and, where the cell
    was steered, what D2 measured; one line naming what the run does not hold."""
    from poolbench.pooler.pooled_table import PooledTableView, read_pooled_table, stored_layers
    from poolbench.pooler.registry import resolve_strategies
    from poolbench.steerer.run import steering_vector
    from poolbench.store.url import open_run_store

    doc = read_run(run)
    strategy = resolve_strategies([strategy])[0].id
    layer = choose_layer(doc, run, concept, strategy, layer)
    pooled = ((doc.get("artifacts") or {}).get(concept) or {}).get("pooled")
    if not pooled and (doc.get("config") or {}).get("drop_pooled"):
        raise ExportError(f"--concept: {run} dropped its pooled vectors once each concept's D1 was stored "
                          "(--drop-pooled): run it again with --keep-pooled to export a vector")
    if not pooled:
        concepts = sorted(c for c, a in (doc.get("artifacts") or {}).items() if a.get("pooled"))
        raise ExportError(f"--concept: {run} has no pooled table for '{concept}' (run concepts: "
                          f"{', '.join(concepts) or 'none'})")
    cells = [r for r in _steered_cells(doc, concept, strategy) if int(r["layer"]) == layer]
    cell = cells[0] if cells else None
    site = str((cell or {}).get("site") or "residual")
    norms = [float(r["residual_norm"]) for r in doc.get("d2") or []
             if r.get("concept") == concept and int(r.get("layer", -1)) == layer and r.get("residual_norm")]
    if unit == "residual" and not norms:
        raise ExportError(f"--unit residual: {run} measured no residual norm for '{concept}' at layer {layer} "
                          "(no D2 cell there); use --unit raw for the DiffMean at its own length")
    store = open_run_store(doc)
    if layer not in stored_layers(store, pooled):
        raise ExportError(f"--layer: {run} pooled '{concept}' at layers "
                          f"{', '.join(map(str, stored_layers(store, pooled)))}, not {layer}")
    try:
        vector = steering_vector(PooledTableView(read_pooled_table(store, pooled, [layer])), concept, strategy, layer)
    except PoolBenchError as exc:
        raise ExportError(str(exc).splitlines()[0]) from exc
    if vector.direction is None:
        raise ExportError(f"{concept}/{strategy}/L{layer} has no steering vector: {vector.null_reason}")
    scale = norms[0] if unit == "residual" else vector.raw_norm
    metadata = {**_provenance(doc, concept, strategy, layer, site), **_steering_metadata(cell),
                "unit": unit, "vector_norm": float(scale), "diffmean_norm": float(vector.raw_norm),
                "alpha_meaning": ("alpha = 1 adds residual_norm x the unit DiffMean direction, D2's alpha"
                                  if unit == "residual" else "alpha = 1 adds the DiffMean vector at its own length")}
    if norms:
        metadata["residual_norm"] = norms[0]
    delta = (float(scale) * vector.direction.astype(np.float64)).astype(np.float32)
    return ExportedVector(concept, strategy, layer, site, delta, metadata)
