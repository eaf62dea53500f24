"""Word lists for the valence-bias score: one word or phrase a line, '#' comments; defaults in data/."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from poolbench.errors import PoolBenchError

DEFAULT_DOMAIN = "valence_domain_furniture.txt"
DEFAULT_POSITIVE = "valence_positive.txt"
DEFAULT_NEGATIVE = "valence_negative.txt"


class WordListError(PoolBenchError):
    """A word list file that is missing, empty, or holds a word that cannot be used."""


@dataclass(frozen=True)
class WordList:
    """Words in file order with the line each came from, so errors can name file:line."""

    source: str
    words: tuple[str, ...]
    lines: tuple[int, ...]

    def where(self, index: int) -> str:
        return f"{self.source}:{self.lines[index]}"


def parse_word_list(text: str, source: str) -> WordList:
    """Words from file text: blank lines and '#' comments skipped; empty lists and repeats are errors."""
    words, lines, seen = [], [], {}
    for line_no, raw in enumerate(text.splitlines(), start=1):
        word = raw.split("#", 1)[0].strip()
        if not word:
            continue
        if word in seen:
            raise WordListError(f"{source}:{line_no}: word {word!r} already listed on line {seen[word]}")
        if "{" in word or "}" in word:
            raise WordListError(f"{source}:{line_no}: word {word!r} contains a brace")
        seen[word] = line_no
        words.append(word)
        lines.append(line_no)
    if not words:
        raise WordListError(f"{source}: word list is empty")
    return WordList(source, tuple(words), tuple(lines))


def load_word_list(path: str | Path | None, default: str) -> WordList:
    """A user file, or the shipped default `default` (a file name in poolbench/data) when path is None."""
    if path is None:
        text = resources.files("poolbench").joinpath("data", default).read_text(encoding="utf-8")
        return parse_word_list(text, f"poolbench/data/{default}")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WordListError(f"{path}: cannot read word list ({type(exc).__name__})") from None
    return parse_word_list(text, str(path))
