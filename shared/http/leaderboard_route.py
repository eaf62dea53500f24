"""GET /leaderboard: a finished run's leaderboard as the service was started with it; for a run over several
models the cross-model table (per-model D1 with intervals, ranks, relative depth, Kendall's W, who is best)."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from poolbench.errors import PoolBenchError


def leaderboard_of_run(run: str | Path) -> dict:
    """{"leaderboard": ...} read once at start from a run folder's leaderboard.json (a cross-model run's holds the
    cross-model table); a missing or unreadable file stops the start in one line."""
    path = Path(run) / "leaderboard.json"
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise PoolBenchError(f"{path}: no such file ('{run}' is not a finished run folder)") from exc
    except json.JSONDecodeError as exc:
        raise PoolBenchError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from exc
    return {"leaderboard": document}


def run_serving(run: Path) -> dict:
    """What a run folder adds to the service: its leaderboard (when it has one) and, for a single-model run, the
    scorers and stored vectors it recorded; a cross-model run's are in its models' folders, so it adds its table."""
    from poolbench.http.settings import scorers_of_run, vectors_of_run

    served = leaderboard_of_run(run) if (run / "leaderboard.json").is_file() else {}
    if served.get("leaderboard", {}).get("kind") == "cross_model":
        return served
    return {**served, **scorers_of_run(run), **vectors_of_run(run)}


def add_leaderboard_route(api: FastAPI, leaderboard: dict) -> None:
    """The route answers the document it was given; without one, 404 saying how to start with a run."""

    @api.get("/leaderboard")
    def served_leaderboard() -> JSONResponse:
        if not leaderboard:
            return JSONResponse(status_code=404, content={
                "detail": "this service was started without a run: start it with --run <finished run folder>"})
        return JSONResponse(content=leaderboard)
