"""What every bench script shares: the model/batching options, writing its result JSON, the tests' helpers."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from types import ModuleType

from rich.console import Console

RESULTS = Path(__file__).parent / "results"


def tests_module(name: str) -> ModuleType:
    """A module of tests/ (no package: loaded from its file), so a bench measures against what the tests hold (a
    reference implementation, their real S3 server) instead of a copy of it."""
    path = Path(__file__).parents[1] / "tests" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--corpus-size", default="small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)


def run_header(benchmark: str, args: argparse.Namespace, device: object) -> dict:
    """Provenance every bench JSON starts with: what ran, where, from which code, with which options."""
    import platform

    import torch

    from poolbench.provenance import git_hash, package_versions, utc_now

    return {"benchmark": benchmark, "date": utc_now(), "git_hash": git_hash(), "versions": package_versions(),
            "machine": {"platform": platform.platform(), "torch_threads": torch.get_num_threads(),
                        "device": str(device)},
            "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}


def write_result(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    Console().print(f"wrote {out}")
