"""The prompts steering continues: the shipped neutral prompts or a user file, and concept instructions."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

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
