"""docs/contenders.md, generated: do the learned aggregators beat the card's best (and from which training size),
which strategies keep their D1 as contexts grow, which activation site is best. Every number is read from a
contenders run's results.json / leaderboard.json / answer.json and a learning curve's learning_curve.json."""

from __future__ import annotations

import json
from pathlib import Path

from poolbench.atomic_write import write_text_atomic
from poolbench.errors import PoolBenchError
from poolbench.results.answer.answer import ANSWER_FILE, read_answer
from poolbench.results.answer.answer_verdicts import comparison_line
from poolbench.results.answer.axes import interval_text, site_sentences
from poolbench.results.answer.learning_curve import CURVE_FILE, LEARNED_FAMILY, curve_sentences, curve_table

PAGE = "contenders.md"


def _read(path: Path) -> dict:
    if not path.is_file():
        raise PoolBenchError(f"{path}: not found (run `make run-contenders`, or name a finished run)")
    return json.loads(path.read_text())


def _minutes(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds / 60:.1f} min"


def _passes(documents: list[dict]) -> tuple[int, int]:
    """(concept passes pooled by these runs, passes read back from the store) from results.json's `computed`."""
    done = read = 0
    for doc in documents:
        for name, count in (doc.get("computed") or {}).items():
            if name.startswith("pooled_skipped"):
                read += int(count)
            elif name.startswith("pooled"):
                done += int(count)
    return done, read


def wall_time(seconds: float | None, documents: list[dict]) -> str:
    """A run's wall time, saying when some of its passes were computed by an earlier invocation (a resumed or
    repeated run reads them back from the store, so its time is not what computing them costs)."""
    done, read = _passes(documents)
    if not read:
        return _minutes(seconds)
    return (f"{_minutes(seconds)}, with {read} of {done + read} concept passes read back from the store (computed "
            "by an earlier invocation, not in this time)")


def site_rows(sites: dict) -> list[str]:
    names = sites["sites"]
    strategies = sorted({s for table in sites["by_site"].values() for s in table})
    lines = ["| strategy | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for s in strategies:
        cells = [f"{interval_text(sites['by_site'][n][s]['d1'])} (L{sites['by_site'][n][s]['layer']})"
                 if s in sites["by_site"][n] else "—" for n in names]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return lines


def length_rows(lengths: dict) -> list[str]:
    ks = [str(k) for k in lengths["lengths"]]
    head = ["strategy", "layer", *[f"D1 at {k}x" for k in ks], *[f"change at {k}x" for k in ks[1:]]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s, e in lengths["by_strategy"].items():
        cells = [interval_text(e["d1"][k]) if k in e["d1"] else "—" for k in ks]
        cells += [f"{interval_text(e['change'][k], signed=True)} ({e['reading'][k]})" if k in e["change"] else "—"
                  for k in ks[1:]]
        lines.append(f"| {s} | {e['layer']} | " + " | ".join(cells) + " |")
    return lines


def _concepts(leaderboard: dict) -> list[str]:
    return sorted({c for r in leaderboard.get("strategies") or [] for c in r.get("per_concept") or {}})


def _run_scope(results: dict, leaderboard: dict) -> str:
    """Concepts, layers and strategies a run read, in one phrase."""
    concepts = _concepts(leaderboard)
    layers = ", ".join(str(layer) for layer in results.get("layers") or []) or "?"
    return (f"{len(concepts)} concepts ({', '.join(concepts)}), layers {layers}, "
            f"{len(leaderboard.get('strategies') or [])} strategies")


def curve_scope(documents: list[dict]) -> str:
    """What the learning curve's runs read: corpus, concepts, layers and the held-out passages every size shares."""
    first = documents[0]
    corpus, config = first.get("corpus") or {}, first.get("config") or {}
    concepts = sorted({c["concept"] for c in first.get("cells") or []})
    limit = config.get("test_limit")
    test = "the whole test split" if limit is None else f"the first {limit} test passages per class (pairs whole)"
    layers = ", ".join(str(layer) for layer in first.get("layers") or []) or "?"
    return (f"The curve's runs: corpus {str(corpus.get('hash', '?'))[:12]} ({corpus.get('size', '?')}), "
            f"{len(concepts)} concepts ({', '.join(concepts)}), layers {layers}; every size is read on {test}.\n")


def render_contenders(results: dict, leaderboard: dict, answer_sentences: list[str], verdict_lines: list[str],
                      curve: dict | None, curve_documents: list[dict] | None = None,
                      axes: tuple[dict, dict] | None = None) -> str:
    """The page; `curve_documents` are the learning curve's runs' results.json (None: no curve folder given), and
    `axes` (results, leaderboard) is the run the site and length sections are read from when it is not the main
    run (a smaller run: every other site and length is one more pooling pass over its concepts)."""
    curve_seconds = None if curve_documents is None else sum(
        float((d.get("timing") or {}).get("total_s", 0.0)) for d in curve_documents)
    model = (results.get("model") or {}).get("model_id", "?")
    corpus = results.get("corpus") or {}
    axes_results, axes_board = axes if axes is not None else (results, leaderboard)
    axes_note = "" if axes is None else (
        f" The site and context-length sections are read from a second run of the same model and corpus over "
        f"{_run_scope(axes_results, axes_board)} "
        f"({wall_time((axes_results.get('timing') or {}).get('total_s'), [axes_results])}).")
    learned = [r["strategy"] for r in leaderboard.get("strategies") or [] if r.get("family") == LEARNED_FAMILY]
    lines = [
        "# The contenders of 2025-26: learned aggregators, context length, activation sites",
        "",
        f"Generated by `poolbench-driver contenders` (`make run-contenders`) from a run of {model} on corpus "
        f"{str(corpus.get('hash', '?'))[:12]} ({corpus.get('size', '?')}), git {str(results.get('git_hash'))[:10]}, "
        f"{results.get('date', '?')}. No number on this page is typed by hand. Wall time: the run "
        f"{wall_time((results.get('timing') or {}).get('total_s'), [results])}, the learning curve "
        f"{wall_time(curve_seconds, curve_documents or [])}. "
        f"The run: {_run_scope(results, leaderboard)}.{axes_note}",
        "",
        "## Do the learned aggregators beat the card's best?",
        "",
        f"Learned aggregators run: {', '.join(learned) or 'none'}. The run's answer (best chosen on training CV, "
        "each other strategy's verdict against it):",
        "",
        *[f"- {s}" for s in answer_sentences],
        "",
        "```",
        *verdict_lines,
        "```",
        "",
        "### Learning curve",
        "",
    ]
    if curve is None:
        lines.append("No learning curve was given (`poolbench-driver contenders --curve FOLDER`).")
    else:
        lines += [curve["reading"] + ".", "", *([curve_scope(curve_documents)] if curve_documents else []),
                  *[f"- {s}" for s in curve_sentences(curve)], "",
                  "Mean held-out D1 [95% t-interval over concepts] by training passages per concept:", "",
                  *curve_table(curve)]
    lines += ["", "## Which strategies keep their D1 as contexts grow?", ""]
    if lengths := axes_board.get("context_lengths"):
        lines += [lengths["reading"] + ".", "", *length_rows(lengths)]
    else:
        lines.append("This run read no other context length (`run --context-lengths 1,4`).")
    lines += ["", "## Which activation site is best?", ""]
    if sites := axes_board.get("sites"):
        lines += [*[f"- {s}" for s in site_sentences(sites)], "", *site_rows(sites)]
    else:
        lines.append("This run read no other site (`run --sites residual,attn,mlp`).")
    return "\n".join(lines) + "\n"


def write_contenders(run_dir: Path, curve_dir: Path | None, out_dir: Path, *, axes_dir: Path | None = None) -> Path:
    results = _read(run_dir / "results.json")
    leaderboard = _read(run_dir / "leaderboard.json")
    axes = None if axes_dir is None else (_read(axes_dir / "results.json"), _read(axes_dir / "leaderboard.json"))
    if axes is not None and (axes[0].get("model") or {}).get("model_id") != (results.get("model") or {}).get(
            "model_id"):
        raise PoolBenchError(f"{axes_dir / 'results.json'}: model {(axes[0].get('model') or {}).get('model_id')!r} "
                             f"is not the run's {(results.get('model') or {}).get('model_id')!r}")
    answer = read_answer(run_dir / ANSWER_FILE)
    curve = _read(curve_dir / CURVE_FILE) if curve_dir is not None else None
    documents = None if curve_dir is None else [
        _read(p / "results.json") for p in sorted(curve_dir.iterdir()) if (p / "results.json").is_file()]
    verdicts = [comparison_line(c) for c in answer.verdicts.comparisons] if answer.verdicts is not None else []
    page = render_contenders(results, leaderboard, list(answer.sentences), verdicts, curve, documents, axes)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PAGE
    write_text_atomic(path, page)
    return path
