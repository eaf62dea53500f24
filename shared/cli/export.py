"""`export-vector`: a run's steering vector out of the store as a GGUF control vector, safetensors or torch file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from poolbench.cli.options import DEFAULT_RUN

console = Console()


def export_vector(
    concept: Annotated[str, typer.Option(help="the concept whose vector to export")],
    strategy: Annotated[str, typer.Option(help="pooling strategy id or short code")],
    run_dir: Annotated[Path, typer.Option("--run", help="a finished run's --out folder")] = DEFAULT_RUN,
    layer: Annotated[int | None, typer.Option(help="decoder layer; default the layer the run steered the cell at")]
        = None,
    fmt: Annotated[str, typer.Option("--format", help="gguf (llama.cpp/repeng control vector), safetensors "
                                                      "({layer: tensor}), or pt")] = "gguf",
    unit: Annotated[str, typer.Option(help="residual: alpha = 1 is D2's alpha (residual-norm scaled); raw: the "
                                           "DiffMean at its own length")] = "residual",
    out: Annotated[Path | None, typer.Option(
        help="folder to write <concept>-<strategy>-L<layer>.<format> into; default the run folder")] = None,
) -> None:
    """Write one (concept, strategy, layer) steering vector at alpha = 1 with its provenance, for other tools."""
    from poolbench.results.exports.vector_export import ExportError, exported_vector
    from poolbench.results.exports.vector_formats import FORMATS, check_expressible, write_vector

    if fmt not in FORMATS:
        raise ExportError(f"--format: '{fmt}' is not one of {', '.join(FORMATS)}")
    if unit not in ("residual", "raw"):
        raise ExportError(f"--unit: '{unit}' is not residual or raw")
    vec = exported_vector(run_dir, concept, strategy, layer, unit="residual" if unit == "residual" else "raw")
    check_expressible(vec, fmt)
    folder = out if out is not None else run_dir
    folder.mkdir(parents=True, exist_ok=True)
    target = write_vector(vec, fmt, folder)
    console.print(f"wrote {target} ({vec.hook_point}, |v| = {vec.metadata['vector_norm']:.4g}, unit {unit})")
