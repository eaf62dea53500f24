"""S2 on the Llama-3.1-8B shape (random bf16 weights): the memory model's rows against what runs, its peak against
the measured one, and timings of the plain forward, the S2 capture and the chunked forward+backward baseline."""
import json
import os
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from poolbench.extractor.batching import free_memory_bytes, gradient_rows_per_forward, rows_per_forward
from poolbench.extractor.capture import capture_chunks, model_token_costs
from poolbench.extractor.extraction_stats import ExtractionStats
from poolbench.extractor.forward_baselines import forward_backward, forward_only
from poolbench.extractor.padded_batches import PaddedBatch

OUT = os.environ.get("OUT", "/tmp/out")
out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg)
torch.set_default_dtype(torch.float32)
model.eval().requires_grad_(False)
out["attn"] = model.config._attn_implementation
layers = list(range(32)) if os.environ.get("ALL_LAYERS") else [0, 6, 12, 19, 25, 31]
out["layers"] = layers
L, rows_in = 512, 32
def batch(seed):
    ids = np.random.default_rng(seed).integers(3, 128000, (rows_in, L))
    m = np.ones((rows_in, L), bool)
    return PaddedBatch(list(range(rows_in)), [f"p{i}" for i in range(rows_in)], ["x"] * rows_in, ids, m,
                       np.zeros((rows_in, L, 2), np.int32), np.zeros((rows_in, L), bool))
batches = [batch(1), batch(2)]
class Null:
    def __call__(self, layer, hidden, extras): pass
    def finish(self): pass
torch.cuda.synchronize()
weights = torch.cuda.memory_allocated()
free = free_memory_bytes("cuda")
costs = model_token_costs(model, layers, {"gradient"})
out.update(weights_bytes=weights, free_bytes=free, costs=costs.__dict__,
           plain_rows=rows_per_forward(costs, 8192, L), s2_rows=gradient_rows_per_forward(costs, 8192, L, free),
           s2_rows_uncapped=gradient_rows_per_forward(costs, 64 * L, L, free))
out["predicted_peak_extra_bytes"] = out["s2_rows"] * L * (costs.plain + costs.gradient) + costs.head_chunk
print(json.dumps(out), flush=True)
def timed(fn, name):
    fn(batches[:1])  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    stats = fn(batches)
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    out[name] = {"seconds": s, "tokens_per_s": rows_in * L * len(batches) / s,
                 "peak_extra_bytes": torch.cuda.max_memory_allocated() - weights, "chunks": stats.batches}
    print(name, json.dumps(out[name]), flush=True)
def capture(bs, needs):
    stats = ExtractionStats()
    for _ in capture_chunks(model, model.model.layers, bs, layers, sink_for=lambda c: Null(), needs=needs,
                            max_batch_tokens=8192, stats=stats):
        pass
    return stats
timed(lambda bs: forward_only(model, bs), "raw")
if not os.environ.get("ALL_LAYERS"):
    timed(lambda bs: capture(bs, frozenset()), "hidden_capture")
timed(lambda bs: capture(bs, frozenset({"gradient"})), "s2_capture")
if not os.environ.get("ALL_LAYERS"):
    timed(lambda bs: forward_backward(model, bs, max_batch_tokens=8192), "forward_backward_chunked")
for k in [k for k in ("hidden_capture", "s2_capture", "forward_backward_chunked") if k in out]:
    out[k]["over_raw"] = out["raw"]["tokens_per_s"] / out[k]["tokens_per_s"]
os.makedirs(OUT, exist_ok=True)
name = "s2_memory_gpu_all_layers.json" if os.environ.get("ALL_LAYERS") else "s2_memory_gpu.json"
with open(os.path.join(OUT, name), "w") as handle:
    json.dump(out, handle, indent=1)
print(json.dumps(out, indent=1))
