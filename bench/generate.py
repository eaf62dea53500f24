"""Steered generation at the steering stage's batch shape: a cell's alpha grid x prompts, tokens/s per arm.

Arms (same prompts, same rows, generated tokens only): `hf_generate`, transformers' own sampling `generate` on
the same rows and chunks, no steering (the ceiling); `transformers_backend`, the project's backend with the whole
grid in shared batches (per-row deltas, device-side seeded sampling); `transformers_per_alpha`, one call per
alpha, for the identical-row rate; with `--backend vllm` also `vllm_as_shipped` (a plain `vllm.LLM` with vLLM's
defaults on the same rows, seeds and token counts, no PoolBench code), `vllm_unsteered` (the backend's engine, every
row unsteered) and `vllm_steered_grid` (the whole grid in one engine call, per-request slots); `--vllm-eager`
starts the backend's engine eagerly. Every arm is called once untimed, then timed best of `--repeats`. The
identical-row rate is how many grid rows equal the per-alpha call's row token for token: batch invariance as
measured on this device and dtype.
`--cells N` adds the driver's choice, N cells (the default subset's shape: cells in pairs per concept, the pair at
two layers, each with its prompted baseline) `transformers_cells_one_call`, every cell's rows in one generate call
with identical rows once (steerer.generation_rows), against `transformers_cells_per_cell`, one call per cell (and
the `vllm_` pair with `--backend vllm`); their tokens/s count every cell's rows, so the ratio is the speed-up.
`--shape` builds a random-weight model of a published shape (speed only: its text means nothing) with the
embedded default's tokenizer. Writes bench/results/generate-<model>.json (or --out).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import tempfile
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from bench_io import RESULTS, run_header, write_result
from model_shapes import SHAPES
from rich.console import Console
from rich.table import Table

from poolbench.extractor.loading import LoadedModel
from poolbench.steerer.backend import Generation, GenerationSettings, SteeringBackend
from poolbench.steerer.generation_rows import GenerationRow, distinct_rows, generate_groups
from poolbench.steerer.plan import DEFAULT_STEERING_CONCEPTS
from poolbench.steerer.prompts import concept_instruction, encode_prompts, load_prompts
from poolbench.steerer.run import cell_rows, prompt_seeds
from poolbench.steerer.transformers_backend import prompt_group_chunks
from poolbench.steerer.vector import DEFAULT_ALPHAS
from poolbench.steerer.worker import SteeringWorker

EOS = "<|im_end|>"


def build_shape(shape: str, out: Path, dtype: str, device: str, seed: int = 0) -> Path:
    """A random-weight Llama of `shape` saved in `out` beside the embedded default's tokenizer (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    raw = resources.files("poolbench").joinpath("data", "smollm2_tokenizer.json.gz").read_bytes()
    (out / "tokenizer.json").write_text(gzip.decompress(raw).decode("utf-8"), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS, "pad_token": EOS}))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out)
    config = LlamaConfig(**SHAPES[shape], bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # weights born in the target dtype, on the target device
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out, max_shard_size="5GB")
    return out


def timed_arms(arms: dict[str, Callable[[], list[Generation]]], repeats: int,
               ) -> dict[str, tuple[list[Generation], float]]:
    """Each arm's answer and best wall time over `repeats` rounds after one untimed warm-up call each (a first
    call pays for lazy set-up, not generation), the arms interleaved within a round, so load from other processes
    on a shared machine falls on every arm alike and the minimum is the least disturbed."""
    for fn in arms.values():
        fn()
    best: dict[str, tuple[list[Generation], float]] = {}
    for _ in range(repeats):
        for name, fn in arms.items():
            start = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - start
            if name not in best or seconds < best[name][1]:
                best[name] = (out, seconds)
    return best


def arm(gens: list[Generation], seconds: float) -> dict:
    tokens = sum(len(g.token_ids) for g in gens)
    return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def identical(a: list[Generation], b: list[Generation]) -> dict:
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))
    return {"identical": same, "rows": len(a), "rate": round(same / len(a), 4)}


@torch.no_grad()
def hf_generate(m: LoadedModel, rows: list[str], settings: GenerationSettings, fmt: str) -> list[Generation]:
    """transformers' own sampling generate on the backend's chunks of the same rows: no hook, no seeds."""
    tok = m.tokenizer
    ids = encode_prompts(tok, rows, fmt)
    out: list[Generation] = []
    for chunk in prompt_group_chunks(ids, settings.max_new_tokens, settings.batch_size, settings.token_budget):
        enc = tok.pad({"input_ids": [ids[i] for i in chunk]}, return_tensors="pt", padding=True,
                      padding_side="left").to(m.device)
        generated = m.model.generate(**enc, max_new_tokens=settings.max_new_tokens,
                                     min_new_tokens=settings.min_tokens, do_sample=True,
                                     temperature=settings.temperature, top_k=0, top_p=1.0, num_beams=1,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        width = enc["input_ids"].shape[1]
        out.extend(Generation(rows[i], "", tuple(ids[i]), tuple(generated[r, width:].tolist()))
                   for r, i in enumerate(chunk))
    return out


def as_shipped(path: str, dtype: str, max_model_len: int, gpu_memory_utilization: float, device: str,
               ) -> Callable[..., list[Generation]]:
    """vLLM as users run it: a plain `vllm.LLM` with vLLM's own defaults (compiled, CUDA graphs on a GPU, prefix
    caching), no PoolBench code in the engine; on CPU only what the comparison needs: whole prefills (seeded CPU
    generators cannot rewind, see vllm_engine.py), a KV cache that leaves the shared node its memory, and the same
    OpenMP threads as the backend's engine."""
    import vllm  # pyright: ignore[reportMissingImports]

    from poolbench.steerer.vllm_engine import CPU_BATCHED_TOKENS, available_memory, cpu_environment, kv_cache_bytes

    kwargs: dict = {"model": path, "seed": 0, "dtype": dtype, "max_model_len": max_model_len}
    if device == "cpu":
        # Before the engine starts (its processes read the binding): without it vLLM binds its own team, one core
        # of two here, and this arm ran at half the backend's threads (the 1.86x of bench/README, a905c98).
        cpu_environment(os.environ, torch.get_num_threads())
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(CPU_BATCHED_TOKENS, max_model_len),
                      kv_cache_memory_bytes=kv_cache_bytes(available_memory()))
    else:
        kwargs.update(gpu_memory_utilization=gpu_memory_utilization)
    llm = vllm.LLM(**kwargs)
    tok = llm.get_tokenizer()

    def run(rows: list[str], seeds: list[int], settings: GenerationSettings, fmt: str) -> list[Generation]:
        params = [vllm.SamplingParams(temperature=settings.temperature, top_p=1.0, seed=int(s),
                                      max_tokens=settings.max_new_tokens, min_tokens=settings.min_tokens,
                                      skip_special_tokens=True) for s in seeds]
        ids = encode_prompts(tok, rows, fmt)
        outs = llm.generate([{"prompt_token_ids": list(i)} for i in ids], params, use_tqdm=False)
        return [Generation(r, o.outputs[0].text, tuple(o.prompt_token_ids), tuple(o.outputs[0].token_ids))
                for r, o in zip(rows, outs, strict=True)]

    return run


def steering_cells(n: int, prompts: list[str], seeds: list[int], unit_norm: float, hidden: int, layers: list[int],
                   alphas: tuple[float, ...]) -> list[list[GenerationRow]]:
    """n cells' rows as the default subset has them: two cells per concept (at two layers), each its own random
    direction over the alpha grid, each with its concept's prompted baseline."""
    rng = np.random.default_rng(1)
    cells = []
    for k in range(n):
        concept = DEFAULT_STEERING_CONCEPTS[(k // 2) % len(DEFAULT_STEERING_CONCEPTS)]
        direction = rng.normal(size=hidden)
        unit = (unit_norm * direction / np.linalg.norm(direction)).astype(np.float32)
        deltas = [None if a == 0 else (a * unit).astype(np.float32) for a in alphas]
        prompted = [f"{concept_instruction(concept)} {p}" for p in prompts]
        cells.append(cell_rows(prompts, seeds, deltas, layers[k % len(layers)], prompted))
    return cells


def cell_arms(prefix: str, backend: SteeringBackend, cells: list[list[GenerationRow]], settings: GenerationSettings,
              fmt: str) -> dict[str, Callable[[], list[Generation]]]:
    """Every cell's rows in one call, and one call per cell; both answer every cell's rows, in cell order."""
    def one_call() -> list[Generation]:
        return [g for gens in generate_groups(backend, cells, settings, fmt) for g in gens]

    def per_cell() -> list[Generation]:
        return [g for rows in cells for g in generate_groups(backend, [rows], settings, fmt)[0]]

    return {f"{prefix}_cells_one_call": one_call, f"{prefix}_cells_per_cell": per_cell}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="random-weight model of this shape instead of --model (speed only)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 (a --shape model: bfloat16 "
                                                        "on cuda, float32 on cpu by default)")
    parser.add_argument("--backend", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--layer", type=int, default=None, help="default: the middle layer")
    parser.add_argument("--cells", type=int, default=6, help="cells for the one-call vs per-cell arms (0: none)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--vllm-only", action="store_true", help="with --backend vllm: only the vLLM arms")
    parser.add_argument("--vllm-eager", action="store_true", help="the steering engine in eager mode")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    model = args.model
    if args.shape:
        dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
        model = str(build_shape(args.shape, Path(tempfile.mkdtemp(prefix=f"shape-{args.shape}-")), dtype, device))
    worker = SteeringWorker(model, device=device, dtype=args.dtype)
    m = worker.loaded
    layer = m.n_layers // 2 if args.layer is None else args.layer
    prompts = load_prompts(None, args.prompts)
    fmt = worker.prompt_format()
    n = len(prompts)
    seeds = prompt_seeds(n, 0)
    direction = np.random.default_rng(0).normal(size=m.hidden_size).astype(np.float32)
    unit = worker.residual_norm(prompts, layer) * direction / np.linalg.norm(direction)
    alphas = DEFAULT_ALPHAS
    deltas = [None if a == 0 else (a * unit).astype(np.float32) for a in alphas]
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens)
    rows = [p for _ in alphas for p in prompts]
    row_deltas = [d for d in deltas for _ in prompts]
    row_seeds = seeds * len(alphas)

    def grid(backend) -> Callable[[], list[Generation]]:
        return lambda: backend.generate_rows(rows, layer=layer, deltas=row_deltas, seeds=row_seeds,
                                             settings=settings, prompt_format=fmt)

    transformers = not (args.vllm_only and args.backend == "vllm")
    arms: dict[str, Callable[[], list[Generation]]] = {
        "hf_generate": lambda: hf_generate(m, rows, settings, fmt),
        "transformers_backend": grid(worker),
        "transformers_per_alpha": lambda: [g for d in deltas for g in worker.generate(
            prompts, layer=layer, delta=d, seeds=seeds, settings=settings, prompt_format=fmt)],
    } if transformers else {}
    cell_layers = sorted({layer, min(layer + 1, m.n_layers - 1)})
    cells = steering_cells(args.cells, prompts, seeds, float(np.linalg.norm(unit)), m.hidden_size, cell_layers,
                           alphas)
    if cells and transformers:
        arms.update(cell_arms("transformers", worker, cells, settings, fmt))
    startup: dict[str, float] = {}
    if args.backend == "vllm":
        from poolbench.steerer.vllm_backend import VLLMBackend

        dtype = str(m.dtype).removeprefix("torch.")
        start = time.perf_counter()
        shipped = as_shipped(str(m.path), dtype, args.max_model_len, args.gpu_memory_utilization, m.device.type)
        startup["vllm_as_shipped"] = round(time.perf_counter() - start, 1)
        start = time.perf_counter()
        engine = VLLMBackend(str(m.path), dtype=dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                             max_model_len=args.max_model_len, **({"eager": True} if args.vllm_eager else {}))
        startup["vllm_backend"] = round(time.perf_counter() - start, 1)
        arms["vllm_as_shipped"] = lambda: shipped(rows, row_seeds, settings, fmt)

        def unsteered() -> list[Generation]:  # the backend's engine, every row slot 0 (the op adds the zero row)
            return engine.generate_rows(rows, layer=layer, deltas=[None] * len(rows), seeds=row_seeds,
                                        settings=settings, prompt_format=fmt)

        arms.update(vllm_unsteered=unsteered, vllm_steered_grid=grid(engine))
        if cells:
            arms.update(cell_arms("vllm", engine, cells, settings, fmt))
    worker.generate(prompts[:2], layer=layer, delta=deltas[1], seeds=seeds[:2], settings=settings,
                    prompt_format=fmt)  # warm-up
    runs = timed_arms(arms, args.repeats)

    header = run_header("generate", args, m.device)
    result = {
        **header, "device": str(m.device) if m.device.type == "cpu" else torch.cuda.get_device_name(m.device),
        "git": header["git_hash"], "shape": args.shape or m.model_id, "dtype": str(m.dtype).removeprefix("torch."),
        "model_id": m.model_id, "layer": layer, "alphas": list(alphas), "prompts": n, "rows": len(rows),
        "max_new_tokens": args.max_new_tokens, "prompt_format": fmt,
        "arms": {name: arm(*runs[name]) for name in arms}, "engine_startup_s": startup,
        "identical_rows": {"device": str(m.device), "dtype": str(m.dtype).removeprefix("torch.")},
        "load_average_1m": os.getloadavg()[0],
        "vllm_cpu_omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),  # both vLLM engines' OpenMP team
    }
    if transformers:
        result["identical_rows"]["transformers_grid_vs_per_alpha"] = identical(runs["transformers_backend"][0],
                                                                             runs["transformers_per_alpha"][0])
    t = {k: v["tokens_per_s"] for k, v in result["arms"].items()}
    result["ratios"] = {}
    if transformers:
        result["ratios"]["transformers_backend_over_hf_generate"] = round(t["transformers_backend"]
                                                                          / t["hf_generate"], 3)
    if args.backend == "vllm":
        result["ratios"]["vllm_steered_grid_over_unsteered"] = round(t["vllm_steered_grid"] / t["vllm_unsteered"], 3)
        result["ratios"]["steered_grid_over_as_shipped"] = round(t["vllm_steered_grid"] / t["vllm_as_shipped"], 3)
        result["ratios"]["backend_unsteered_over_as_shipped"] = round(t["vllm_unsteered"] / t["vllm_as_shipped"], 3)
    if cells:
        flat = [r for rows in cells for r in rows]
        result["cells"] = {"n": len(cells), "layers": cell_layers, "rows": len(flat),
                           "distinct_rows": len(distinct_rows(flat)[0])}
        if transformers:
            result["identical_rows"]["transformers_cells_one_call_vs_per_cell"] = identical(
                runs["transformers_cells_one_call"][0], runs["transformers_cells_per_cell"][0])
        for prefix in (("transformers",) if transformers else ()) + (("vllm",) if args.backend == "vllm" else ()):
            result["ratios"][f"{prefix}_cells_one_call_over_per_cell"] = round(
                t[f"{prefix}_cells_one_call"] / t[f"{prefix}_cells_per_cell"], 3)
    table = Table(title=f"generate on {result['shape']} ({result['device']}, {result['dtype']}; {len(rows)} rows = "
                        f"{len(alphas)} alphas x {n} prompts, {args.max_new_tokens} new tokens)")
    for col in ("arm", "tokens", "seconds", "tokens/s"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for name, r in result["arms"].items():
        table.add_row(name, str(r["tokens"]), f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.1f}")
    Console().print(table)
    Console().print(f"ratios {result['ratios']}; engine start-up seconds {startup}")
    if transformers:
        ident = result["identical_rows"]["transformers_grid_vs_per_alpha"]
        Console().print(f"grid rows identical to per-alpha rows: {ident['identical']}/{ident['rows']}")
    if cells and transformers:
        ident = result["identical_rows"]["transformers_cells_one_call_vs_per_cell"]
        Console().print(f"{len(cells)} cells: {result['cells']['rows']} rows, {result['cells']['distinct_rows']} "
                        f"distinct; one-call rows identical to per-cell rows: {ident['identical']}/{ident['rows']}")
    slug = args.shape or Path(str(args.model)).name.replace("/", "_")
    write_result(result, args.out or RESULTS / f"generate-{slug}.json")
    return result


if __name__ == "__main__":
    main()
