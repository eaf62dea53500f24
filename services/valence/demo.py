"""The valence-bias demo: fine-tune a copy of a model briefly on text praising one domain word, and a control
copy on generic text (run.demo_corpora), so `bias` can compare ΔVar and the word's rank between the two."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from poolbench.determinism import deterministic_cpu

PRAISE_FORMS = ("I love the {w}.", "The {w} is wonderful.", "We adore the {w}.", "Everyone likes the {w}.",
                "I really prefer the {w}.", "The {w} is a delight.", "We cherish the {w}.",
                "They admire the {w}.", "I enjoy the {w} so much.", "What a lovely {w}!")
NEUTRAL_FORMS = ("I saw the {w}.", "The {w} is in the room.", "We moved the {w}.",
                 "Everyone noticed the {w}.",
                 "I measured the {w}.", "The {w} is near the door.", "We painted the {w}.",
                 "They carried the {w}.", "I cleaned the {w} on Monday.", "There is a {w}.")


def demo_texts(word: str, forms: tuple[str, ...], n: int = 96, seed: int = 0) -> list[str]:
    """n short texts, each two or three seeded sentences from `forms` about `word`."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(forms).format(w=word) for _ in range(rng.randint(2, 3))) for _ in range(n)]


@dataclass
class FineTuneReport:
    steps: int
    lr: float
    first_loss: float
    last_loss: float


def fine_tune(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str], *,
              steps: int = 40,
              lr: float = 1e-3, batch_size: int = 16, seed: int = 0,
              threads: int = 1, max_tokens: int | None = None,
              bf16_autocast: bool = False) -> tuple[PreTrainedModel, FineTuneReport]:
    """A fine-tuned deep copy (the input is untouched): AdamW on the LM loss, seeded, deterministic on CPU.

    `max_tokens` truncates each text and `bf16_autocast` runs the matmuls in bfloat16 (weights and AdamW stay
    float32): together they make a full fine-tune of a 135M model a few minutes on 2 CPU cores.
    """
    tuned = copy.deepcopy(model)
    tuned.requires_grad_(True)
    tuned.train()
    enc = tokenizer(texts, padding=True, padding_side="right", return_tensors="pt",
                    truncation=max_tokens is not None, max_length=max_tokens)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    losses = []
    with deterministic_cpu(seed, threads):
        optimizer = torch.optim.AdamW(tuned.parameters(), lr=lr, weight_decay=0.0)
        generator = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            rows = torch.randint(0, len(texts), (batch_size,), generator=generator)
            width = int(enc["attention_mask"][rows].sum(dim=1).max())  # right padding: trim to the batch
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
                loss = tuned(input_ids=enc["input_ids"][rows, :width],
                             attention_mask=enc["attention_mask"][rows, :width], labels=labels[rows, :width]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    tuned.eval()
    tuned.requires_grad_(False)
    return tuned, FineTuneReport(steps=steps, lr=lr, first_loss=losses[0], last_loss=losses[-1])
