"""results.json and leaderboard.json, lm-evaluation-harness style: every number with its provenance."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from poolbench.atomic_write import write_json_atomic, write_text_atomic
from poolbench.prober.reliability import across_cells
from poolbench.provenance import git_hash, package_versions, utc_now
from poolbench.records.d1 import D1CellRecord
from poolbench.records.run import RunOutcome
from poolbench.records.steering import SteeringStage
from poolbench.results.answer.answer import ANSWER_FILE, build_answer, write_answer
from poolbench.results.answer.axes import answer_sections, length_section, results_section, site_section
from poolbench.results.answer.leaderboard import build_leaderboard, cells_protocol
from poolbench.results.answer.passage_table import write_run_scores
from poolbench.results.answer.tier_estimand import tier_mixed_ranking
from poolbench.results.answer.tiers import tier_section
from poolbench.results.documents.metric_text import metric_descriptions
from poolbench.results.documents.tidy import LONG_COLUMNS, WIDE_COLUMNS, long_rows, to_csv, wide_rows

RESULTS_SCHEMA_VERSION = 1


def strategy_info(outcome: RunOutcome) -> dict[str, dict]:
    return {s["id"]: s for s in outcome.strategies}


def _across_cells(records: list[D1CellRecord]) -> dict:
    """Win rate and significance compare strategies: with one strategy there is nothing to compare."""
    if len({r.strategy for r in records}) < 2:
        return {"skipped": "win rate and significance need at least two strategies", "win_rate": {}}
    pb = cells_protocol(records) == "pb"  # the pb protocol has the diffmean probe only
    return across_cells([r.to_dict() for r in records], **({"probe": "diffmean"} if pb else {}))


def _steering_sections(steering: SteeringStage | None) -> dict:
    """D2, D3 and the scorers' validity, when the run steered (absent with --no-steering)."""
    if steering is None:
        return {}
    return {"scorers": [s.to_dict() for s in steering["scorers"]], "d2": [r.to_dict() for r in steering["d2"]],
            "d3": [r.to_dict() for r in steering["d3"]],
            "steering": {k: steering[k] for k in ("steering_config", "subset", "timing")}}


def _breakdown_sections(outcome: RunOutcome) -> dict:
    """The lexical baseline per concept and D1 by density / placement, when the run computed them."""
    out: dict = {}
    if outcome.lexical:
        out["lexical_baseline"] = [r.to_dict() for r in outcome.lexical]
    if outcome.d1_buckets:
        out["d1_by_bucket"] = [r.to_dict() for r in outcome.d1_buckets]
    if outcome.d1_tiers:
        out["d1_by_tier"] = [r.to_dict() for r in outcome.d1_tiers]
    if outcome.lexical_tiers:
        out["lexical_by_tier"] = [r.to_dict() for r in outcome.lexical_tiers]
    if outcome.d1_tiers:
        out["estimand"] = _estimand(outcome)
    if outcome.steerability is not None:
        out["steerability"] = outcome.steerability
    return out


def _estimand(outcome: RunOutcome) -> dict:
    """The declared tier estimand and the ranking on it (tier_estimand.py), for results.json and the leaderboard."""
    return tier_mixed_ranking(outcome.d1_tiers, pair_counts=outcome.corpus.get("tier_pairs"))


def results_document(outcome: RunOutcome) -> dict:
    return {
        "schema_version": RESULTS_SCHEMA_VERSION,
        "date": utc_now(),
        "git_hash": git_hash(),
        "versions": package_versions(),
        "config": outcome.config.model_dump(mode="json"),
        "seed": outcome.config.seed,
        "model": outcome.model,
        "corpus": outcome.corpus,
        "layers": outcome.layers,
        "strategies": outcome.strategies,
        "store": outcome.store,
        "artifacts": outcome.artifacts,
        "computed": outcome.computed,
        "timing": outcome.timing,
        "cluster": outcome.cluster.to_dict(),
        "metrics": metric_descriptions(outcome.records, outcome.lexical, outcome.config.n_folds),
        "reliability": _across_cells(outcome.records),
        "cells": [r.to_dict() for r in outcome.records],
        **_steering_sections(outcome.steering),
        **({"errors": [{"stage": "steering", "message": outcome.steering_error}]} if outcome.steering_error else {}),
        **_breakdown_sections(outcome),
        **results_section(outcome.config.sites, outcome.config.context_lengths, outcome.axis_records,
                          outcome.axis_artifacts),
    }


def _leaderboard_steering(steering: SteeringStage | None) -> dict:
    """Per-strategy steering means and each scorer's validity, for the leaderboard of a run that steered."""
    if steering is None:
        return {}
    from poolbench.steerer.plan import steering_summary

    return {"steering": steering_summary(steering["d2"], steering["d3"]),
            "scorers": {s.concept: {"heldout_auroc": s.heldout_auroc, "valid": s.valid} for s in steering["scorers"]}}


def _axes_sections(outcome: RunOutcome) -> dict:
    """The sites' and context lengths' sections of the leaderboard (results.answer.axes), empty without the axes."""
    if not outcome.axis_records:
        return {}
    cfg = outcome.config
    return {**site_section(outcome.records, outcome.axis_records, rope=cfg.rope, n_bootstrap=cfg.n_bootstrap,
                           seed=cfg.seed),
            **length_section(outcome.records, outcome.axis_records, rope=cfg.rope)}


def run_stamp(now: dt.datetime | None = None) -> str:
    """The UTC date-time in a run's file names (lm-evaluation-harness style): sortable, no colons (Windows)."""
    return (now or dt.datetime.now(dt.timezone.utc)).strftime("%Y-%m-%dT%H-%M-%S.%f")


def write_run_outputs(outcome: RunOutcome, out_dir: Path, stamp: str | None = None) -> dict[str, Path]:
    """results_<stamp>.json and leaderboard_<stamp>.json, kept per run, then results.json and leaderboard.json,
    the latest, which every reader opens, and the leaderboard as a tidy long CSV beside a short wide one; each
    written atomically, so a reader never sees half a file."""
    stamp = stamp or run_stamp()
    results = results_document(outcome)
    reliability = results["reliability"]
    friedman = reliability.get("friedman") or {}
    leaderboard = build_leaderboard(
        outcome.records, strategy_info=strategy_info(outcome), win_rate=reliability["win_rate"],
        average_ranks=friedman.get("average_ranks", {}), lexical=outcome.lexical or None,
        sections={"model": outcome.model, "corpus_hash": outcome.corpus["hash"], "git_hash": results["git_hash"],
                  "date": results["date"], "friedman": reliability.get("friedman"),
                  **({"by_tier": tier_section(outcome.d1_tiers, outcome.lexical_tiers)}
                     if outcome.d1_tiers or outcome.lexical_tiers else {}),
                  **({"estimand": _estimand(outcome)} if outcome.d1_tiers else {}),
                  **_axes_sections(outcome),
                  **_leaderboard_steering(outcome.steering)},
        estimand=_estimand(outcome) if outcome.d1_tiers else None)
    paths = {"results_stamped": out_dir / f"results_{stamp}.json",
             "leaderboard_stamped": out_dir / f"leaderboard_{stamp}.json",
             "results": out_dir / "results.json", "leaderboard": out_dir / "leaderboard.json",
             "leaderboard_long": out_dir / "leaderboard_long.csv", "leaderboard_wide": out_dir / "leaderboard_wide.csv"}
    for name, document in (("results", results), ("leaderboard", leaderboard)):
        write_json_atomic(paths[f"{name}_stamped"], document)
        write_json_atomic(paths[name], document)
    write_text_atomic(paths["leaderboard_long"], to_csv(long_rows(results, leaderboard), LONG_COLUMNS))
    if outcome.passage_scores is not None:
        paths["passage_scores"] = write_run_scores(outcome.passage_scores, out_dir)
    answer = build_answer(results, leaderboard, outcome.passage_scores, sections=answer_sections(leaderboard))
    paths["answer_stamped"], paths["answer"] = out_dir / f"answer_{stamp}.json", out_dir / ANSWER_FILE
    for path in (paths["answer_stamped"], paths["answer"]):
        write_answer(answer, path)
    write_text_atomic(paths["leaderboard_wide"], to_csv(wide_rows(leaderboard, answer.verdicts), WIDE_COLUMNS))
    return paths
