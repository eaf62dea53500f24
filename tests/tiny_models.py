"""Tiny models for tests: the tiny recipe at toy size in HF format, and GGUF files written from such a model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from poolbench.corpus.english import generated_texts
from poolbench.extractor import tiny_model

CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}" \
                "{% if add_generation_prompt %}<s>assistant:{% endif %}"


def tiny_tokenizer(vocab: int = 320) -> PreTrainedTokenizerFast:
    """The tiny model's byte-level BPE recipe on generated text (seconds on CPU)."""
    return tiny_model.train_tokenizer(generated_texts(200, seed=3), vocab_size=vocab)


def save_tiny_llama(path: Path, *, seed: int = 0, layers: int = 2, hidden: int = 32, vocab: int = 320,
                    weight_std: float | None = None) -> Path:
    """A random-weight Llama with a byte-level BPE tokenizer trained on generated text (seconds on CPU).
    `weight_std` redraws every weight matrix at that scale: at the default init (0.02) each block adds little to
    the residual stream, so a delta added after layer 0 or after layer 1 gives the same text."""
    tokenizer = tiny_tokenizer(vocab)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=2, intermediate_size=2 * hidden,
                         max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if weight_std is not None:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() > 1:
                    param.normal_(0, weight_std)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tied_gqa_llama(tokenizer: PreTrainedTokenizerFast, *, seed: int = 0) -> LlamaForCausalLM:
    """2 layers, d=64, 4 query heads over 2 KV heads, tied embeddings: SmolLM2's shape in miniature.

    Every row length (64, 128) is a multiple of 32, the block size of GGUF's 8-bit quantisations.
    """
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved rotary halves); transformers undoes it when it reads a GGUF."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def llama_gguf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's tensor names, as its converter writes them (no output.weight when tied)."""
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out |= {
            f"blk.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"blk.{i}.attn_q.weight": _llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads),
            f"blk.{i}.attn_k.weight": _llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads),
            f"blk.{i}.attn_v.weight": sd[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": sd[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
            f"blk.{i}.ffn_gate.weight": sd[p + "mlp.gate_proj.weight"],
            f"blk.{i}.ffn_up.weight": sd[p + "mlp.up_proj.weight"],
            f"blk.{i}.ffn_down.weight": sd[p + "mlp.down_proj.weight"],
        }
    return out


def write_tiny_gguf(path: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, *,
                    architecture: str = "llama", quant: str = "F32", raw_tensor: tuple[str, str] | None = None,
                    ) -> Path:
    """Write `model` and its byte-level BPE tokenizer (vocabulary, merges, special ids, chat template) as a GGUF.

    `quant` ("F32", "Q8_0", ...) quantises every 2-D weight with the gguf package; `raw_tensor=(name, type)`
    writes that tensor as zero bytes of a GGUF type instead (for types the package cannot dequantise).
    """
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import quantize

    cfg = model.config
    writer = GGUFWriter(path, architecture)
    writer.add_name("poolbench tiny llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)

    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    specials = set(tokenizer.all_special_tokens)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control, 1: normal
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    qtype = GGMLQuantizationType[quant]
    for name, weights in llama_gguf_tensors(model).items():
        if raw_tensor is not None and name == raw_tensor[0]:
            rtype = GGMLQuantizationType[raw_tensor[1]]
            block, size = GGML_QUANT_SIZES[rtype]
            raw = np.zeros((weights.shape[0], weights.shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=rtype)
        elif weights.ndim == 2 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(name, quantize(weights, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, weights.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_llama() -> LlamaForCausalLM:
    """A 3-layer random Llama with weights large enough that gradients and saliency differ across tokens."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=50)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
    return model.requires_grad_(False)
