"""ScorerModel: a fine-tuned classifier B loaded from its folder, scoring texts in batches.

Folder layout: the encoder in Hugging Face format (config.json, model.safetensors, tokenizer files; loads
with AutoModel), `scorer_head.safetensors` (the linear head on mean-pooled tokens) and
`poolbench_scorer.json` (concept, training config, held-out validity).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .errors import ScorerError
from .finetune import MeanPoolClassifier, load_encoder

SCORER_INFO_FILE = "poolbench_scorer.json"
HEAD_FILE = "scorer_head.safetensors"


class ScorerModel:
    """P(concept | text) = sigmoid(head(mean-pooled encoder states))."""

    def __init__(self, model: MeanPoolClassifier, tokenizer, info: dict, max_length: int = 64) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.info = info
        self.max_length = max_length

    @property
    def concept(self) -> str:
        return str(self.info.get("concept", "?"))

    @classmethod
    def load(cls, folder: str | Path) -> ScorerModel:
        folder = Path(folder)
        try:
            info = json.loads((folder / SCORER_INFO_FILE).read_text())
            tokenizer, encoder = load_encoder(str(folder), str(folder))
            model = MeanPoolClassifier(encoder)
            model.head.load_state_dict(load_file(folder / HEAD_FILE))
        except Exception as exc:  # any unreadable piece means the same thing to the user: a bad artefact
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ScorerError(f"scorer folder '{folder}' is missing or corrupt: {first}") from exc
        model.requires_grad_(False)
        return cls(model, tokenizer, info, int(info.get("config", {}).get("max_length", 64)))

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.model.encoder.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in self.model.head.state_dict().items()}, folder / HEAD_FILE)
        (folder / SCORER_INFO_FILE).write_text(json.dumps(self.info, indent=1, sort_keys=True) + "\n")

    def batches(self, texts: Sequence[str], batch_size: int = 64) -> Iterator[tuple[np.ndarray, dict]]:
        """(positions in `texts`, tokenized batch) in scoring order: length-sorted so each batch pads little.
        shared_trunk.py batches the same way, so its probabilities are score's bit for bit."""
        texts = list(texts)
        order = np.argsort([len(t) for t in texts], kind="stable")
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            yield idx, self.tokenizer([texts[j] for j in idx], padding=True, truncation=True,
                                      max_length=self.max_length, return_tensors="pt")

    @torch.no_grad()
    def score(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """Probabilities [len(texts)] in input order."""
        out = np.empty(len(texts), dtype=np.float64)
        for idx, enc in self.batches(texts, batch_size):
            out[idx] = torch.sigmoid(self.model(**enc).float()).numpy()
        return out
