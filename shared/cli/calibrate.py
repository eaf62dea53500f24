"""`calibrate`: the known-answer check of a model's pooling, a thin shell over poolbench.driver.calibration."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from poolbench.atomic_write import write_json_atomic
from poolbench.cli.options import out_folder
from poolbench.defaults import EMBEDDED
from poolbench.errors import PoolBenchError

console = Console()


def _model_args(text: str | None) -> dict[str, str]:
    pairs = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PoolBenchError(f"--model-args: '{item}' is not key=value")
        pairs[key.strip()] = value.strip()
    return pairs


def calibrate(
    model: Annotated[str, typer.Option(help="HF id or local path; 'embedded' is the built-in model")] = EMBEDDED,
    model_args: Annotated[str | None, typer.Option(help="from_pretrained kwargs, k=v,k=v")] = None,
    layer: Annotated[int | None, typer.Option(help="layer to probe; default the middle one")] = None,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:1")] = "auto",
    store: Annotated[str | None, typer.Option(help="artifact store: a folder or s3://bucket/prefix")] = None,
    batch_size: Annotated[int, typer.Option(help="passages per forward pass")] = 32,
    seed: Annotated[int, typer.Option(help="seed for probes and bootstrap")] = 0,
    n_bootstrap: Annotated[int, typer.Option(help="bootstrap resamples for the gap CIs")] = 1000,
    out: Annotated[Path | None, typer.Option(help="also write calibration.json into this folder")] = None,
) -> None:
    """Known-answer calibration: planted signals whose winning pooling is known; each expectation held or not."""
    from poolbench.driver.calibration import run_calibration

    report = run_calibration(model, layer=layer, model_args=_model_args(model_args), dtype=dtype, device=device,
                             store=store, batch_size=batch_size, seed=seed, n_bootstrap=n_bootstrap)
    table = Table(title=f"Calibration of {report['model']['model_id']} at layer {report['layer']} "
                        f"(held-out AUROC gap, {report['ci_level']:.0%} CI over matched pairs)")
    for column in ("expectation", "AUROC", "versus", "gap", "CI", "result"):
        table.add_column(column, justify="left" if column in ("expectation", "result") else "right")
    for row in report["expectations"]:
        if row["held"] is None:
            table.add_row(row["statement"], "", "", "", "", row["note"])
            continue
        table.add_row(row["statement"], f"{row['auroc']:.3f}", f"{row['versus_auroc']:.3f}", f"{row['gap']:+.3f}",
                      f"[{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]", "held" if row["held"] else "NOT HELD",
                      style=None if row["held"] else "red")
    console.print(table)
    if out is not None:
        target = out_folder(out) / "calibration.json"
        write_json_atomic(target, report)
        console.print(f"wrote {target}")
