"""What every bench script shares: the model/batching options and writing its result JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

RESULTS = Path(__file__).parent / "results"


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--corpus-size", default="small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)


def write_result(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    Console().print(f"wrote {out}")
