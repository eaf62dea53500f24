"""Token counts of the default model's tokenizer (SmolLM2-135M's, shipped gzipped in poolbench/data).

The corpus is generated offline and must record what the default model will see: its tokenizer ships with
the package, so counting needs neither the model nor a network.
"""

from __future__ import annotations

import gzip
from collections.abc import Sequence
from functools import lru_cache
from importlib import resources

from tokenizers import Tokenizer

DEFAULT_TOKENIZER_FILE = "smollm2_tokenizer.json.gz"


@lru_cache(maxsize=1)
def default_tokenizer() -> Tokenizer:
    """The default model's fast tokenizer, loaded once per process."""
    data = resources.files("poolbench").joinpath("data", DEFAULT_TOKENIZER_FILE).read_bytes()
    return Tokenizer.from_str(gzip.decompress(data).decode("utf-8"))


def count_tokens(texts: Sequence[str]) -> list[int]:
    """Tokens per text without special tokens, as `validate-corpus --tokenizer` counts them."""
    tokenizer = default_tokenizer()
    return [len(tokenizer.encode(text, add_special_tokens=False).ids) for text in texts]
