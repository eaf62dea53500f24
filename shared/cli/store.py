"""`store verify`: check every artifact's sha256 in a store, and quarantine the corrupt ones on request."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from poolbench.errors import PoolBenchError

console = Console()


def verify(
    store: Annotated[str | None, typer.Option(help="folder or s3://bucket/prefix; default ~/.cache/poolbench/store")]
    = None,
    prefix: Annotated[str, typer.Option(help="only keys starting with this, e.g. pooled/")] = "",
    quarantine: Annotated[bool, typer.Option(help="move corrupt artifacts to quarantine/ so runs recompute them")]
    = False,
) -> None:
    """Verify every artifact; exits 1 when one is corrupt (0 once all are whole or quarantined)."""
    from poolbench.store.url import open_store

    artifacts = open_store(store)
    n = len([k for k in artifacts.list(prefix) if not k.startswith("quarantine/")])
    bad = artifacts.verify(prefix, quarantine=quarantine)
    for key, reason in bad:
        console.print(f"{'quarantined' if quarantine else 'corrupt'}: {key} ({reason})", highlight=False)
    console.print(f"{n - len(bad)} of {n} artifacts whole in {artifacts.describe()}", highlight=False)
    if bad and not quarantine:
        raise PoolBenchError(f"{len(bad)} corrupt artifact(s): rerun with --quarantine to move them aside")
