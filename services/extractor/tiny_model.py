"""The `tiny` model: a small Llama plus byte-level BPE tokenizer, trained from scratch on CPU.

It exists so tests and smoke runs need no download and no real model: `ensure_tiny_model()` builds it once
into the cache and every later run loads it like any Hugging Face model directory. (It was the embedded
default before SmolLM2-135M-Instruct took that role.)

Determinism scope: the same texts, config and seed give bit-identical weights for the same torch version,
CPU kind and `threads` (training pins the thread count, seeds a forked RNG and enables
`torch.use_deterministic_algorithms`); a different torch version or thread count may differ in the last bits.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    get_cosine_schedule_with_warmup,
)

from poolbench.defaults import cache_dir as poolbench_cache_dir
from poolbench.determinism import deterministic_cpu

MODEL_FAMILY = "embedded-llama-v1"  # its cache name from its embedded days: renaming would retrain
BUILD_INFO_FILE = "poolbench_build.json"
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyModelConfig:
    """Everything that determines the tiny model's weights besides the texts and the seed."""

    vocab_size: int = 4096
    hidden_size: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    intermediate_size: int = 688
    max_position_embeddings: int = 256
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 200
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    threads: int = 1
    heldout_fraction: float = 0.05
    max_heldout_sequences: int = 64


DEFAULT_CONFIG = TinyModelConfig()


@dataclass
class BuildReport:
    """What a build did and how well it learned; also written to the model dir as poolbench_build.json."""

    out_dir: Path
    config: dict[str, Any]
    seed: int
    steps: int
    train_seconds: float
    tokens_seen: int
    tokens_per_second: float
    heldout_perplexity: float
    heldout_tokens: int
    n_train_texts: int
    n_heldout_texts: int
    texts_sha256: str
    tokenizer_vocab_size: int  # below config vocab_size when the texts run out of merges
    torch_version: str = torch.__version__
    transformers_version: str = transformers.__version__
    tokenizers_version: str = tokenizers.__version__
    losses: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "out_dir": str(self.out_dir)}


def texts_digest(texts: Sequence[str]) -> str:
    """sha256 over the texts, length-prefixed so that different splits of the same characters differ."""
    h = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE whose offsets are character spans into the original text, with a Llama-style <s> prefix.

    Offsets (ByteLevel post-processing with trim_offsets): a token's span excludes the leading spaces it
    encodes, so whitespace-only tokens get an empty span (end, end). A token holding only some bytes of a
    multi-byte character gets the span of that whole character, shared by every token holding its bytes.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def _packed_sequences(token_lists: Sequence[list[int]], bos: int, eos: int, seq_len: int) -> torch.Tensor:
    """Concatenate <s> text </s> documents and cut them into rows that each start with <s>, as inference."""
    stream = [t for ids in token_lists for t in (bos, *ids, eos)]
    body = seq_len - 1
    n_rows = len(stream) // body
    if n_rows == 0:
        raise ValueError(f"tiny model: texts give {len(stream)} tokens, under one {seq_len}-token row")
    rows = torch.tensor(stream[: n_rows * body], dtype=torch.long).view(n_rows, body)
    return torch.cat([torch.full((n_rows, 1), bos, dtype=torch.long), rows], dim=1)


def _llama_config(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _heldout_perplexity(model: LlamaForCausalLM, rows: torch.Tensor, batch_size: int) -> tuple[float, int]:
    model.eval()
    total_loss, total_tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            n_predicted = batch.numel() - len(batch)
            total_loss += float(model(input_ids=batch, labels=batch).loss) * n_predicted
            total_tokens += n_predicted
    return math.exp(total_loss / total_tokens), total_tokens


def build_tiny_model(
    out_dir: str | Path,
    texts: Sequence[str],
    *,
    seed: int = 0,
    steps: int | None = None,
    config: TinyModelConfig = DEFAULT_CONFIG,
    on_step: Callable[[int, float], None] | None = None,
    **overrides: Any,
) -> BuildReport:
    """Train tokenizer and Llama on `texts` into `out_dir` atomically: an interrupted build leaves no out_dir.

    `overrides` replace fields of `config` (e.g. hidden_size=64); `on_step(step, loss)` runs after each step.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"tiny model: '{out_dir}' already exists")
    cfg = replace(config, **overrides, **({} if steps is None else {"steps": steps}))
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    n_heldout = max(1, round(len(texts) * cfg.heldout_fraction))
    heldout = [texts[i] for i in sorted(order[:n_heldout])]
    train = [texts[i] for i in sorted(order[n_heldout:])]

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        report = _train_into(tmp_dir, train, heldout, cfg, seed, on_step)
        report.out_dir = out_dir
        report.texts_sha256 = texts_digest(texts)
        (tmp_dir / BUILD_INFO_FILE).write_text(json.dumps(report.to_json(), indent=2) + "\n")
        os.rename(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return report


def _train_into(
    tmp_dir: Path, train: list[str], heldout: list[str], cfg: TinyModelConfig, seed: int,
    on_step: Callable[[int, float], None] | None,
) -> BuildReport:
    tokenizer = train_tokenizer(train, cfg.vocab_size)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    encode = tokenizer.backend_tokenizer.encode_batch
    train_ids = [e.ids for e in encode(train, add_special_tokens=False)]
    heldout_ids = [e.ids for e in encode(heldout, add_special_tokens=False)]
    train_rows = _packed_sequences(train_ids, bos, eos, cfg.seq_len)
    heldout_rows = _packed_sequences(heldout_ids, bos, eos, cfg.seq_len)[: cfg.max_heldout_sequences]

    with deterministic_cpu(seed, cfg.threads):
        model = LlamaForCausalLM(_llama_config(cfg, tokenizer))
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                      weight_decay=cfg.weight_decay)
        schedule = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.steps)
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(train_rows), generator=generator)
        cursor, losses = 0, []
        start = time.perf_counter()
        for step in range(cfg.steps):
            if cursor + cfg.batch_size > len(order):
                order, cursor = torch.randperm(len(train_rows), generator=generator), 0
            batch = train_rows[order[cursor : cursor + cfg.batch_size]]
            cursor += cfg.batch_size
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            if on_step is not None:
                on_step(step, losses[-1])
        train_seconds = time.perf_counter() - start
        perplexity, heldout_tokens = _heldout_perplexity(model, heldout_rows, cfg.batch_size)

    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    tokens_seen = cfg.steps * cfg.batch_size * cfg.seq_len
    return BuildReport(
        out_dir=tmp_dir, config=asdict(cfg), seed=seed, steps=cfg.steps,
        train_seconds=round(train_seconds, 2),
        tokens_seen=tokens_seen, tokens_per_second=round(tokens_seen / max(train_seconds, 1e-9), 1),
        heldout_perplexity=perplexity, heldout_tokens=heldout_tokens, n_train_texts=len(train),
        n_heldout_texts=len(heldout), texts_sha256="", tokenizer_vocab_size=len(tokenizer), losses=losses,
    )


def tiny_training_texts() -> list[str]:
    """What the tiny model learns English from: the embedded corpus's train split (never its test split),
    more unlabelled passages from the same concept generators, and everyday templated prose."""
    from poolbench.corpus.corpus_versions import generate_embedded_corpus
    from poolbench.corpus.embedded import generate_lm_text

    corpus = generate_embedded_corpus(size="small", seed=0, version=1)
    train = [p.text for passages in corpus.values() for p in passages if p.split == "train"]
    from poolbench.corpus.english import generated_texts, vocabulary_texts

    return train + generate_lm_text(6000, seed=1) + generated_texts(2000, seed=0) + vocabulary_texts(1500, seed=0)


def tiny_model_dir(texts: Sequence[str], config: TinyModelConfig, seed: int = 0,
                       cache_dir: str | Path | None = None) -> Path:
    """models/embedded-llama-v1-<short hash of config, seed and texts>: a new recipe gets a new directory."""
    recipe = json.dumps({"config": asdict(config), "seed": seed, "texts": texts_digest(texts)},
                        sort_keys=True)
    key = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    return Path(cache_dir or poolbench_cache_dir()) / "models" / f"{MODEL_FAMILY}-{key}"


def tiny_model_ready(cache_dir: str | Path | None = None) -> bool:
    """Whether the default recipe's model is already built (so a run can say it is about to train one)."""
    out_dir = tiny_model_dir(tiny_training_texts(), DEFAULT_CONFIG, cache_dir=cache_dir)
    return (out_dir / BUILD_INFO_FILE).is_file()


def ensure_tiny_model(cache_dir: str | Path | None = None) -> Path:
    """The tiny model's directory, built first if missing (minutes on 2 CPU cores, once per recipe).

    Processes that ask at once (the extractors of a run on one machine, a test session's background build and a
    test) build it once: the first holds an exclusive lock beside the directory while it trains, the others wait
    for the lock and then find the model built, instead of each training the same weights for minutes."""
    texts = tiny_training_texts()
    out_dir = tiny_model_dir(texts, DEFAULT_CONFIG, cache_dir=cache_dir)
    if (out_dir / BUILD_INFO_FILE).is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
        if (out_dir / BUILD_INFO_FILE).is_file():  # built by whoever held the lock before
            return out_dir
        log.info("building the tiny model into %s (once; a few minutes on CPU)", out_dir)
        try:
            report = build_tiny_model(out_dir, texts, config=DEFAULT_CONFIG)
            log.info("tiny model built in %.0f s, held-out perplexity %.2f", report.train_seconds,
                     report.heldout_perplexity)
        except OSError:
            # a file system whose locks do not hold across machines: another build renamed its directory first
            if not (out_dir / BUILD_INFO_FILE).is_file():
                raise
        lock_path.unlink(missing_ok=True)  # whoever comes later finds the model first and never looks for it
    return out_dir
