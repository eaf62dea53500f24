"""The run's live display: the driver's events as rich progress bars on a terminal, plain lines in a CI log."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from poolbench.cli.progress import LineProgress
from poolbench.records.events import (
    ArtifactQuarantined,
    CellProgress,
    CellSteered,
    ConceptPooled,
    ConceptProbed,
    ConceptProgress,
    JobRetried,
    LayerProbed,
    ModelBuilding,
    PoolingFitted,
    PoolingRoom,
    RunEvent,
    RunPlanned,
    ScorerReady,
    SteeringPlanned,
    SteeringStarted,
)

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress


def run_progress(console: Console) -> Progress | LineProgress:
    """Bars on a terminal; one plain line per stage step when stdout is a pipe or a file (CI logs)."""
    if not console.is_terminal:
        return LineProgress(sys.stdout)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[last]}"), TimeElapsedColumn(), console=console)


class RunDisplay:
    """Renders the driver's run events as progress bars (or plain lines), by event type."""

    def __init__(self, progress: Progress | LineProgress) -> None:
        self.progress = progress
        self.tasks: dict[str, int] = {}

    def show(self, event: RunEvent) -> None:
        bar = self.progress.update
        match event:
            case ModelBuilding():
                self.progress.console.print(f"preparing model '{event.model}' (once: converting its GGUF or "
                                            "training tiny, cached afterwards) ...")
            case RunPlanned():
                self.progress.console.print(
                    f"model {event.model_id} ({event.n_layers} layers, d={event.hidden_size}), "
                    f"{len(event.concepts)} concepts, layers {list(event.layers)}, "
                    f"{len(event.strategies)} strategies, {event.workers} worker(s)"
                    + (f", passes {', '.join(event.variants)}" if len(event.variants) > 1 else ""), markup=False)
                self.tasks["pool"] = self.progress.add_task("pool", total=event.passes, last="")
                self.tasks["probe"] = self.progress.add_task("probe D1", total=event.passes, last="")
            case ConceptPooled(concept=concept, skipped=skipped, seconds=seconds):
                bar(self.tasks["pool"], advance=1, last=f"{concept} ({'cached' if skipped else f'{seconds:.1f}s'})")
            case ConceptProgress():
                eta = "" if event.eta_s is None else f", ETA {event.eta_s:.0f}s"
                bar(self.tasks["pool"], last=f"{event.label}: {event.passages_done}/{event.passages_total} passages, "
                                             f"{event.batches} batches, {event.tokens_done:,} tokens{eta}")
            case CellProgress():
                eta = "" if event.eta_s is None else f", ETA {event.eta_s:.0f}s"
                more = f" and {event.cells - 1} more cells" if event.cells > 1 else ""
                bar(self.tasks["steer"], last=f"{event.concept}/{event.strategy} L{event.layer}{more}: "
                                              f"{event.tokens_done:,}/{event.tokens_total:,} tokens{eta}")
            case LayerProbed():
                bar(self.tasks["probe"], last=f"{event.concept} layer {event.layer}: {event.cells} cells in "
                                              f"{event.probe_s:.1f}s")
            case ConceptProbed(concept=concept, skipped=skipped):
                bar(self.tasks["probe"], advance=1, last=f"{concept} ({'cached' if skipped else 'done'})")
            case SteeringPlanned():
                self.tasks["scorer"] = self.progress.add_task("scorers", total=event.scorers, last="")
                self.tasks["steer"] = self.progress.add_task("steer D2/D3", total=event.cells, last="")
            case ScorerReady():
                bar(self.tasks["scorer"], advance=1,
                    last=f"{event.concept} (held-out AUROC {event.heldout_auroc:.2f})")
            case JobRetried() | PoolingFitted() | PoolingRoom():
                self.progress.console.print(event.line, highlight=False, markup=False)
            case SteeringStarted(engines=engines) if engines:
                self.progress.console.print(f"steering engines: {'; '.join(engines)}", highlight=False, markup=False)
            case ArtifactQuarantined():
                self.progress.console.print(f"warning: {event.key} is corrupt ({event.reason}): moved to "
                                            f"quarantine/{event.key}, recomputing", highlight=False)
            case CellSteered():
                scp = "null" if event.scp is None else f"SCP {event.scp:+.2f}"
                bar(self.tasks["steer"], advance=1, last=f"{event.concept}/{event.strategy} ({scp})")
