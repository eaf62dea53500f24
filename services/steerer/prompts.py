"""The prompts steering continues: the shipped neutral prompts or a user file, concept instructions, and how
a prompt is put to the model (a chat template's user turn for instruct models, plain text for base models)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from .errors import SteeringError


def _read_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def load_prompts(path: str | Path | None = None, n: int | None = None) -> list[str]:
    """The first `n` prompts of `path` (one per line, '#' comments) or of the shipped neutral prompts."""
    if path is None:
        text = resources.files("poolbench").joinpath("data/neutral_prompts.txt").read_text(encoding="utf-8")
        where = "shipped neutral_prompts.txt"
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SteeringError(f"prompts file '{path}' cannot be read: {exc}") from exc
        where = f"prompts file '{path}'"
    prompts = _read_lines(text)
    if not prompts:
        raise SteeringError(f"{where} holds no prompts (one per line; '#' lines are comments)")
    if n is not None:
        if n < 2:
            raise SteeringError(f"need at least 2 prompts for D2's two halves, asked for {n}")
        prompts = prompts[:n]
    return prompts


def concept_instruction(concept: str) -> str:
    """The prompted baseline's instruction for a concept (a generic one for concepts not in the table)."""
    table = json.loads(resources.files("poolbench").joinpath("data/concept_instructions.json")
                       .read_text(encoding="utf-8"))
    return table.get(concept) or f"Write text that shows {concept.replace('_', ' ')}."


PROMPT_FORMATS = ("auto", "chat", "plain")
# Internal, not a user's option: text the caller already formatted (an OpenAI chat request's messages through the
# chat template, a decoded token-id prompt), read as it is with no special tokens added.
RENDERED = "rendered"


def resolve_prompt_format(tokenizer: PreTrainedTokenizerBase, option: str = "auto") -> str:
    """'chat' or 'plain': instruct models (a tokenizer with a chat template) answer a user turn, base models
    continue text; 'auto' decides from the tokenizer, 'chat'/'plain' override it."""
    if option == RENDERED:
        return option
    if option not in PROMPT_FORMATS:
        raise SteeringError(f"prompt format '{option}' is not one of {', '.join(PROMPT_FORMATS)}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if option == "chat" and not has_template:
        raise SteeringError("prompt format 'chat' needs a tokenizer with a chat template; this one has none")
    if option == "auto":
        return "chat" if has_template else "plain"
    return option


def format_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, prompt_format: str) -> str:
    """The text the model reads: the prompt as one user turn plus the generation prompt, or the prompt."""
    if prompt_format in ("plain", RENDERED):
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], prompt_format: str,
                   ) -> list[list[int]]:
    """Token ids of each formatted prompt. A chat template writes its own special tokens (a BOS among them
    where the model has one), so the tokenizer adds none to it; plain prompts get the usual ones."""
    texts = [format_prompt(tokenizer, p, prompt_format) for p in prompts]
    return tokenizer(texts, add_special_tokens=prompt_format == "plain")["input_ids"]
