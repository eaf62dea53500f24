"""Paper estimate: tokens/s and peak memory per extraction stage for a model we cannot run here (Llama-3.1-8B on
one 80 GB H100 at bf16), from FLOP counts, the batching module's memory model and the ratios extraction_cost.py
measured on the default model.

No model is loaded: everything is arithmetic on a model's shape. Per token, a forward costs 2 FLOPs per matmul
weight plus 4*d per attended key (QK^T and PV; causal kernels attend (T+1)/2 keys on average); a backward to the
inputs costs the same matmuls again and twice the attention (weight gradients, which PoolBench never takes, would
add one more forward's matmuls). A stage's ratio to the raw forward on the target is its FLOP ratio there times
the overhead the bench measured on the reference model beyond that model's own FLOP ratio (CPU-time ratios, which
a shared machine moves less). Memory: batching.token_costs per padded token, the budget default_max_batch_tokens
picks from the GPU's free memory, rows_per_forward's chunk, plus the weights. Writes
bench/results/paper_estimate.json.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_io import RESULTS, write_result
from rich.console import Console
from rich.table import Table

from poolbench.extractor.batching import (
    DEFAULT_MAX_BATCH_TOKENS,
    MEMORY_FRACTION,
    TokenCosts,
    default_max_batch_tokens,
    rows_per_forward,
    token_costs,
)

STAGES = ("raw", "hidden", "attention", "gradient", "all", "forward_backward")
STAGE_NEEDS: dict[str, frozenset[str]] = {
    "raw": frozenset(), "hidden": frozenset(), "attention": frozenset({"attention"}),
    "gradient": frozenset({"gradient"}), "all": frozenset({"attention", "gradient"}),
    "forward_backward": frozenset({"gradient"}),
}
H100_BF16_DENSE_FLOPS = 989e12  # NVIDIA H100 SXM datasheet, bf16 tensor cores without sparsity
H100_BYTES = 80e9  # nominal HBM of the 80 GB card
CUDA_CONTEXT_BYTES = 1e9  # an assumption: the CUDA context and allocator slack, outside max_memory_allocated
PAPER_CORPUS = {"concepts": 17, "passages_per_concept": 2000, "tokens_per_passage": 400}


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs of a decoder-only Llama-style model (gated MLP, grouped-query attention)."""

    name: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool

    @property
    def kv_size(self) -> int:
        return self.hidden_size // self.n_heads * self.n_kv_heads


LLAMA_31_8B = ModelShape("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256, tied_embeddings=False)
SMOLLM2_135M = ModelShape("SmolLM2-135M-Instruct", 30, 576, 9, 3, 1536, 49152, tied_embeddings=True)
SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "smollm2-135m": SMOLLM2_135M}


def layer_matmul_params(shape: ModelShape) -> int:
    """Weights one token multiplies through in a block: q and o (d x d), k and v (d x kv), gate/up/down."""
    d = shape.hidden_size
    return 2 * d * d + 2 * d * shape.kv_size + 3 * d * shape.intermediate_size


def parameter_count(shape: ModelShape) -> int:
    """All weights: embedding, blocks (with their two RMSNorms), final norm and an untied LM head."""
    d = shape.hidden_size
    embedding = shape.vocab_size * d
    head = 0 if shape.tied_embeddings else embedding
    return embedding + shape.n_layers * (layer_matmul_params(shape) + 2 * d) + d + head


def attention_flops(shape: ModelShape, context: int) -> int:
    """QK^T and PV per token and layer, with a causal kernel's mean of (T+1)/2 keys: 4*d*(T+1)/2."""
    return 2 * shape.hidden_size * (context + 1)


def head_flops(shape: ModelShape) -> int:
    return 2 * shape.vocab_size * shape.hidden_size


def forward_flops(shape: ModelShape, context: int, *, depth: int, lm_head: bool) -> int:
    """Per token: `depth` blocks, and the LM head only when asked (S2's log-likelihood needs it)."""
    block = 2 * layer_matmul_params(shape) + attention_flops(shape, context)
    return depth * block + (head_flops(shape) if lm_head else 0)


def backward_flops(shape: ModelShape, context: int, *, blocks: int, weight_grads: bool = False) -> int:
    """Per token, from the LM head down through `blocks` blocks: the input gradients repeat every matmul and
    double the attention (dP, dV, dQ, dK); weight gradients would repeat the matmuls once more."""
    matmul = 2 * layer_matmul_params(shape)
    per_block = matmul + 2 * attention_flops(shape, context) + (matmul if weight_grads else 0)
    head = head_flops(shape) * (2 if weight_grads else 1)
    return blocks * per_block + head


def attention_recompute_flops(shape: ModelShape, context: int, n_layers: int) -> int:
    """S1/S3 recompute one layer's full T x T scores in float32 per requested layer: 2*d*T per token."""
    return n_layers * 2 * shape.hidden_size * context


def stage_flops(shape: ModelShape, context: int, stage: str, layers: Sequence[int]) -> int:
    """FLOPs per token of one bench stage (extraction_cost.py's names) over `layers`."""
    deepest, first = max(layers) + 1, min(layers)
    n = shape.n_layers
    full = forward_flops(shape, context, depth=n, lm_head=True)
    flops = {
        "raw": forward_flops(shape, context, depth=n, lm_head=False),
        "hidden": forward_flops(shape, context, depth=deepest, lm_head=False),
        "attention": forward_flops(shape, context, depth=deepest, lm_head=False)
        + attention_recompute_flops(shape, context, len(layers)),
        "gradient": full + backward_flops(shape, context, blocks=n - 1 - first),
        "all": full + backward_flops(shape, context, blocks=n - 1 - first)
        + attention_recompute_flops(shape, context, len(layers)),
        "forward_backward": full + backward_flops(shape, context, blocks=n),
    }
    return flops[stage]


def stage_layers(stage: str, layers: Sequence[int]) -> tuple[int, ...]:
    """The layers a stage captures: none for the raw forward, layer 0 for the forward+backward baseline."""
    return {"raw": (), "forward_backward": (0,)}.get(stage, tuple(layers))


def stage_token_costs(shape: ModelShape, stage: str, layers: Sequence[int], *, itemsize: int,
                      out_itemsize: int) -> TokenCosts:
    """The batching module's per-token bytes for what this stage captures and needs."""
    return token_costs(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                       n_heads=shape.n_heads, vocab_size=shape.vocab_size, n_layers=shape.n_layers,
                       layers=stage_layers(stage, layers), itemsize=itemsize, out_itemsize=out_itemsize,
                       needs=STAGE_NEEDS[stage])


def budget_tokens(shape: ModelShape, layers: Sequence[int], free_bytes: int, *, itemsize: int,
                  out_itemsize: int) -> int:
    """The budget a run gets with no --max-batch-tokens, as resolve_max_batch_tokens computes it."""
    plain = token_costs(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                        n_heads=shape.n_heads, vocab_size=shape.vocab_size, n_layers=shape.n_layers,
                        layers=layers, itemsize=itemsize, out_itemsize=out_itemsize).plain
    return default_max_batch_tokens(free_bytes, plain)


def host_copy_bytes(shape: ModelShape, stage: str, layers: Sequence[int], out_itemsize: int) -> int:
    """Per token, the captured hidden states that go to host memory for pooling (the baselines keep none)."""
    return 0 if stage in ("raw", "forward_backward") else len(layers) * shape.hidden_size * out_itemsize


def chunk_bytes(costs: TokenCosts, rows: int, length: int) -> int:
    """What one forward over `rows` rows of `length` padded tokens holds, in the batching module's model."""
    per_token = costs.plain + costs.attention_per_token + costs.attention_per_key * length + costs.gradient
    return rows * length * per_token + costs.attention_reserve


def transferred_ratio(target_flop_ratio: float, reference_flop_ratio: float, measured_ratio: float) -> float:
    """The target's stage/raw ratio: its FLOP ratio times the overhead measured beyond the reference's."""
    return target_flop_ratio * measured_ratio / reference_flop_ratio


@dataclass(frozen=True)
class StageEstimate:
    stage: str
    flops_per_token: int
    flop_ratio: float  # stage / raw forward FLOPs on the target
    ratio: float  # flop_ratio carried by the measured overhead: the estimate's stage / raw
    tokens_per_s: float
    host_tokens_per_s: float  # adding, unoverlapped, the hidden states' copy to host and (when measured) pooling
    rows_per_forward: int
    chunk_bytes: int
    peak_bytes: int
    unbudgeted_chunk_bytes: int  # the same stage with a whole batch in one forward (no token budget)
    corpus_hours: float


def estimate(shape: ModelShape, measured: dict, *, context: int, layers: Sequence[int], itemsize: int,
             out_itemsize: int, device_bytes: float, mfu: float, peak_flops: float, host_bandwidth: float,
             batch_size: int, corpus_tokens: int, host_pool_seconds: float = 0.0
             ) -> tuple[int, list[StageEstimate]]:
    """Every stage on the target; `measured` is an extraction_cost.json whose model is the reference, and
    `host_pool_seconds` the host's seconds a token for pooling (the extractor pools after each chunk's forward)."""
    reference = shape_of(measured)
    ref_layers = measured["config"]["layers"]
    ref_context = int(measured["config"]["pack_to"] or measured["config"]["max_length"])
    weights = parameter_count(shape) * itemsize
    free = int(device_bytes - weights - CUDA_CONTEXT_BYTES)
    budget = budget_tokens(shape, layers, free, itemsize=itemsize, out_itemsize=out_itemsize)
    raw_flops = stage_flops(shape, context, "raw", layers)
    ref_raw = stage_flops(reference, ref_context, "raw", ref_layers)
    raw_tokens_per_s = mfu * peak_flops / raw_flops
    out = []
    for stage in STAGES:
        flops = stage_flops(shape, context, stage, layers)
        ref_ratio = stage_flops(reference, ref_context, stage, ref_layers) / ref_raw
        measured_ratio = measured["stages"][stage]["cpu_over_raw"] if stage in measured["stages"] else ref_ratio
        ratio = transferred_ratio(flops / raw_flops, ref_ratio, measured_ratio)
        seconds = ratio / raw_tokens_per_s
        copied = host_copy_bytes(shape, stage, layers, out_itemsize)
        host = copied / host_bandwidth + (host_pool_seconds if copied else 0.0)
        costs = stage_token_costs(shape, stage, layers, itemsize=itemsize, out_itemsize=out_itemsize)
        rows = rows_per_forward(costs, budget, context)
        chunk = chunk_bytes(costs, rows, context)
        out.append(StageEstimate(
            stage=stage, flops_per_token=flops, flop_ratio=flops / raw_flops, ratio=ratio,
            tokens_per_s=1 / seconds, host_tokens_per_s=1 / (seconds + host),
            rows_per_forward=rows, chunk_bytes=chunk, peak_bytes=weights + chunk,
            unbudgeted_chunk_bytes=chunk_bytes(costs, batch_size, context),
            corpus_hours=corpus_tokens * (seconds + host) / 3600))
    return budget, out


def host_pooling_seconds(shape: ModelShape, layers: Sequence[int], *, rows: int = 2, length: int = 400,
                         repeats: int = 3) -> float:
    """Measured here: CPU-seconds a token of pool_tokens over the card's strategies that need nothing but hidden
    states, on random hidden states of the target's shape (no model); parses, S1 and S2 pool more on top."""
    import time

    import numpy as np

    from poolbench.extractor.activations import ActivationBatch
    from poolbench.pooler.pool import pool_tokens
    from poolbench.pooler.registry import resolve_strategies

    specs = [spec for spec in resolve_strategies(None) if not spec.needs]
    hidden = np.random.default_rng(0).standard_normal((len(layers), rows, length, shape.hidden_size), dtype=np.float32)
    spans = np.stack([2 * np.arange(length), 2 * np.arange(length) + 1], axis=-1).astype(np.int32)
    batch = ActivationBatch(passage_ids=[str(i) for i in range(rows)], texts=["x" * 2 * length] * rows,
                            layers=tuple(layers), hidden=hidden, attention_mask=np.ones((rows, length), dtype=bool),
                            input_ids=np.ones((rows, length), dtype=np.int64), offsets=np.stack([spans] * rows),
                            special_mask=np.zeros((rows, length), dtype=bool))
    pool_tokens(batch, specs)
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        pool_tokens(batch, specs)
        best = min(best, time.process_time() - start)
    return best / (rows * length)


def shape_of(measured: dict) -> ModelShape:
    """The reference model of a bench JSON, by its width (the bench records n_layers and hidden_size only)."""
    config = measured["config"]
    for shape in SHAPES.values():
        if (shape.n_layers, shape.hidden_size) == (config["n_layers"], config["hidden_size"]):
            return shape
    raise SystemExit(f"bench JSON model {config['model']} ({config['n_layers']} layers, d={config['hidden_size']}) "
                     "is no shape paper_estimate.py knows; measure on the default model (SmolLM2-135M)")


@dataclass(frozen=True)
class Validation:
    """The models against the reference's own measurements: FLOP ratios vs CPU-time ratios, and peak RSS
    predicted as the raw stage's measured peak plus the batching model's extra chunk bytes."""

    stage: str
    flop_ratio: float
    measured_cpu_ratio: float
    predicted_peak_bytes: int
    measured_peak_bytes: int


def validate(measured: dict) -> list[Validation]:
    reference = shape_of(measured)
    config = measured["config"]
    layers = config["layers"]
    context = int(config["pack_to"] or config["max_length"])
    itemsize = 2 if "bfloat16" in config["dtype"] or "float16" in config["dtype"] else 4
    rows_in_batch = min(int(config["batch_size"]), int(config["padded_tokens"]) // context)
    raw_flops = stage_flops(reference, context, "raw", layers)

    def chunk(stage: str) -> int:  # each stage's process resolved its own budget from the memory free then
        costs = stage_token_costs(reference, stage, layers, itemsize=itemsize, out_itemsize=4)
        budget = int(measured["stages"][stage]["max_batch_tokens"])
        return chunk_bytes(costs, min(rows_in_batch, rows_per_forward(costs, budget, context)), context)

    base = measured["stages"]["raw"]["peak_bytes"] - chunk("raw")
    return [Validation(stage=stage, flop_ratio=stage_flops(reference, context, stage, layers) / raw_flops,
                       measured_cpu_ratio=result["cpu_over_raw"], predicted_peak_bytes=base + chunk(stage),
                       measured_peak_bytes=result["peak_bytes"])
            for stage, result in measured["stages"].items()]


def report(result: dict, out: Path) -> None:
    console = Console(width=160)
    a = result["assumptions"]
    table = Table(title=f"{result['model']['name']} on one H100 80 GB, bf16, {a['context']}-token passages, "
                        f"{len(a['layers'])} layers; budget {result['max_batch_tokens']} tokens/forward; "
                        f"{a['mfu']:.0%} of {a['peak_flops'] / 1e12:.0f} TFLOP/s")
    for column in ("stage", "GFLOP/tok", "x raw (FLOPs)", "x raw (est.)", "tok/s GPU", "tok/s +host",
                   "rows/fwd", "chunk GB", "peak GB", "no budget GB", "paper corpus h"):
        table.add_column(column)
    for s in result["stages"]:
        table.add_row(s["stage"], f"{s['flops_per_token'] / 1e9:.2f}", f"{s['flop_ratio']:.3f}", f"{s['ratio']:.3f}",
                      f"{s['tokens_per_s']:,.0f}", f"{s['host_tokens_per_s']:,.0f}", str(s["rows_per_forward"]),
                      f"{s['chunk_bytes'] / 1e9:.2f}", f"{s['peak_bytes'] / 1e9:.1f}",
                      f"{s['unbudgeted_chunk_bytes'] / 1e9:.1f}", f"{s['corpus_hours']:.2f}")
    console.print(table)
    check = Table(title=f"the models against {result['reference']['name']} measured on CPU "
                        f"({result['reference']['bench']})")
    for column in ("stage", "x raw (FLOPs)", "x raw (CPU time)", "peak RSS predicted GB", "measured GB"):
        check.add_column(column)
    for v in result["validation"]:
        check.add_row(v["stage"], f"{v['flop_ratio']:.3f}", f"{v['measured_cpu_ratio']:.3f}",
                      f"{v['predicted_peak_bytes'] / 1e9:.2f}", f"{v['measured_peak_bytes'] / 1e9:.2f}")
    console.print(check)
    write_result(result, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", type=Path, default=RESULTS / "extraction_cost.json",
                        help="extraction_cost.py's JSON on the reference model")
    parser.add_argument("--model", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--context", type=int, default=PAPER_CORPUS["tokens_per_passage"])
    parser.add_argument("--layers", default=None, help="comma list (default: all)")
    parser.add_argument("--mfu", type=float, default=0.45, help="sustained share of the peak (assumed)")
    parser.add_argument("--peak-flops", type=float, default=H100_BF16_DENSE_FLOPS)
    parser.add_argument("--device-bytes", type=float, default=H100_BYTES)
    parser.add_argument("--host-bandwidth", type=float, default=25e9,
                        help="device-to-host bytes/s of the hidden-state copy (assumed, pageable PCIe 5)")
    parser.add_argument("--host-pooling", action="store_true",
                        help="measure pool_tokens at the target's shape on this CPU and add it, over --host-cores")
    parser.add_argument("--host-cores", type=int, default=16, help="host cores pooling scales over (assumed)")
    parser.add_argument("--out-itemsize", type=int, default=4, help="bytes per captured value (4: float32)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS / "paper_estimate.json")
    args = parser.parse_args()
    if not args.measured.exists():
        raise SystemExit(f"{args.measured}: no bench JSON; run bench/extraction_cost.py on the default model first")
    measured = json.loads(args.measured.read_text())
    shape = SHAPES[args.model]
    layers = [int(v) for v in args.layers.split(",")] if args.layers else list(range(shape.n_layers))
    pool_cpu_seconds = host_pooling_seconds(shape, layers) if args.host_pooling else 0.0
    corpus_tokens = PAPER_CORPUS["concepts"] * PAPER_CORPUS["passages_per_concept"] * args.context
    budget, stages = estimate(shape, measured, context=args.context, layers=layers, itemsize=2,
                              out_itemsize=args.out_itemsize, device_bytes=args.device_bytes, mfu=args.mfu,
                              peak_flops=args.peak_flops, host_bandwidth=args.host_bandwidth,
                              batch_size=args.batch_size, corpus_tokens=corpus_tokens,
                              host_pool_seconds=pool_cpu_seconds / args.host_cores)
    reference = shape_of(measured)
    result = {
        "benchmark": "paper_estimate",
        "model": {**asdict(shape), "parameters": parameter_count(shape), "weight_bytes": parameter_count(shape) * 2},
        "reference": {**asdict(reference), "parameters": parameter_count(reference), "bench": str(args.measured),
                      "bench_date": measured.get("date"), "bench_git_hash": measured.get("git_hash")},
        "assumptions": {"context": args.context, "layers": layers, "dtype": "bfloat16",
                        "out_itemsize": args.out_itemsize, "mfu": args.mfu, "peak_flops": args.peak_flops,
                        "device_bytes": args.device_bytes, "cuda_context_bytes": CUDA_CONTEXT_BYTES,
                        "host_bandwidth": args.host_bandwidth, "host_cores": args.host_cores,
                        "host_pool_cpu_seconds_per_token": pool_cpu_seconds, "memory_fraction": MEMORY_FRACTION,
                        "budget_cap": DEFAULT_MAX_BATCH_TOKENS, "batch_size": args.batch_size,
                        "corpus": PAPER_CORPUS, "corpus_tokens": corpus_tokens},
        "max_batch_tokens": budget,
        "stages": [asdict(s) for s in stages],
        "validation": [asdict(v) for v in validate(measured)],
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
