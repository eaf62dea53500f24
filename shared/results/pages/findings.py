"""docs/findings.md, generated from one run's results.json and leaderboard.json, so no finding is copied by hand.

Two steps: `findings_facts` reads the documents into a small JSON of the values the page shows (kept beside it as
findings.json), and `render_findings` only formats those facts; a test regenerates the committed page from the
committed facts."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from poolbench.atomic_write import write_json_atomic, write_text_atomic
from poolbench.errors import PoolBenchError
from poolbench.results.answer.answer import RunAnswer, build_answer, run_answer
from poolbench.results.answer.leaderboard import ranked_on_text
from poolbench.results.answer.near_ties import near_tie_sentence
from poolbench.results.answer.ranking import CI_LEVEL
from poolbench.results.documents.tidy import wide_rows

FACTS_VERSION = 3  # 2: the answer's verdicts against the CV-chosen best; no Nemenyi tie groups; 3: verdicts'
# near-ties from answer.json (no Nemenyi verdicts), ranked_on, the steering guard


def findings_facts(results: dict, leaderboard: dict, *, source: str, sha256: str,
                   answer: RunAnswer | None = None) -> dict:
    """Every value docs/findings.md shows, read from the run's answer (answer.json) and its two documents."""
    answer = answer or build_answer(results, leaderboard)
    probe = leaderboard.get("probe", "logistic")
    first = {c["concept"]: c for c in results.get("cells") or [] if c.get("probe") == probe}
    corpus, model, config = results.get("corpus") or {}, results.get("model") or {}, results.get("config") or {}
    best_name = None if answer.best is None else answer.best.strategy
    best_row = next((r for r in leaderboard.get("strategies") or [] if r["strategy"] == best_name), {})
    lexical = [{"concept": r["concept"], "auroc": r["test_auroc"], "low": r.get("ci_low"), "high": r.get("ci_high"),
                "best_d1": (best_row.get("per_concept") or {}).get(r["concept"], {}).get("auroc")}
               for r in sorted(results.get("lexical_baseline") or [], key=lambda r: r["concept"])]
    timing = {k.removesuffix("_s"): v / 60 for k, v in (results.get("timing") or {}).items()
              if isinstance(v, (int, float)) and k.endswith("_s")}
    return {
        "version": FACTS_VERSION,
        "source": {"results": source, "sha256": sha256, "date": results.get("date"),
                   "git_hash": results.get("git_hash")},
        "run": {"model": model.get("model_id"), "n_layers": model.get("n_layers"),
                "dtype": model.get("dtype"), "corpus": corpus.get("source"), "corpus_size": corpus.get("size"),
                "corpus_hash": str(corpus.get("hash") or "")[:12], "layers": results.get("layers") or [],
                "n_concepts": len(first), "n_strategies": len(leaderboard.get("strategies") or []),
                "n_train": sum(int(c.get("n_train") or 0) for c in first.values()),
                "n_test": sum(int(c.get("n_test") or 0) for c in first.values()),
                "n_bootstrap": config.get("n_bootstrap"), "seed": results.get("seed"),
                "ci_percent": round(100 * CI_LEVEL),
                "minutes": timing},
        "answer": {"verdict": answer.verdict, "sentences": list(answer.sentences),
                   "steering": [asdict(c) for c in answer.steering],
                   "best": best_name,
                   "comparisons": [] if answer.verdicts is None else [
                       {k: v for k, v in asdict(c).items() if k != "pairs"} for c in answer.verdicts.comparisons],
                   "sections": [asdict(x) for x in answer.sections]},
        "leaderboard": wide_rows(leaderboard, answer.verdicts),
        "ranked_on": ranked_on_text(leaderboard),
        "steering_guard": steering_guard(results),
        "tiers": [{"tier": tier, "rows": section.get("rows") or [], "lexical": section.get("lexical") or {}}
                  for tier, section in (leaderboard.get("by_tier") or {}).items()],
        "lexical": lexical,
        "near_ties": [{"strategy": r["strategy"], "layer": r["best_layer"], **r["layer_near_tie"]}
                      for r in leaderboard.get("strategies") or [] if r.get("layer_near_tie")],
    }


def steering_guard(results: dict) -> dict | None:
    """The fluency guard the run's D2 cells ran under, read from their records (None without steering): the
    reference models that judged, the perplexity-ratio bound, the distinct-2 floor, the measure's name; and the
    backends that generated (transformers and vLLM draw other samples from the same seeds, so a page says which)."""
    d2 = [r for r in results.get("d2") or (results.get("steering") or {}).get("d2") or [] if r.get("status") == "ok"]
    if not d2:
        return None

    def values(key: str) -> list:
        return sorted({r[key] for r in d2 if r.get(key) is not None}, key=str)

    return {"reference_models": values("reference_model"), "fluency_guard": values("fluency_guard"),
            "min_distinct_2": values("min_distinct_2"), "fluency_measure": values("fluency_measure"),
            "backends": values("backend")}


def _backend_caption(guard: dict | None) -> str:
    backends = (guard or {}).get("backends") or []
    return f" Continuations generated on the {' and '.join(backends)} backend." if backends else ""


def _guard_caption(guard: dict | None) -> str:
    """What "fluent" meant in the run, from the facts: the same guard for steering (at α*) and prompting."""
    if not guard:
        return ""
    bound = " or ".join(f"{g:g}" for g in guard["fluency_guard"]) or "—"
    if not guard["reference_models"]:  # runs before D2 v4: the steered model, after the prompt
        return (f" Fluent: the continuations' perplexity under the steered model, after the prompt, at most {bound}× "
                "that of the α = 0 continuations (the guard of runs before D2 v4).")
    floor = " or ".join(f"{g:g}" for g in guard["min_distinct_2"]) or "—"
    return (f" Fluent, the same guard for both columns (steered: at α*; prompted: the instruction's continuations), "
            f"on the held-out half of the prompts: perplexity under the reference model "
            f"{', '.join(guard['reference_models'])}, reading each continuation alone without its prompt, at most "
            f"{bound}× that of the α = 0 continuations of the same prompts, and mean distinct-2 (the share of "
            f"distinct word bigrams) at least {floor}.")


def _near_tie_cell(tie: dict | None) -> str:
    """A verdict's near-tie as the verdict table shows it: the boundary, and the verdict across it."""
    if not tie:
        return "—"
    return f"{tie['boundary']} ({_n(tie['value'])} vs {tie['threshold']:g}): else '{tie['other_verdict']}'"


def _old_answer_note(facts: dict) -> list[str]:
    """Facts written before the answer's verdicts (version 1) word the answer in Nemenyi's groups: say so."""
    if int(facts.get("version") or 1) >= 2:
        return []
    return ["> These facts (version 1) predate the answer's verdicts: the 'beats' and 'ties' below are Nemenyi's "
            "critical-difference groups, which decide no verdict now and are no evidence of equivalence "
            "(docs/answer.md). Regenerate this page from a new run.", ""]


def _n(value: object, fmt: str = ".3f") -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return format(value, fmt) if isinstance(value, (int, float)) else str(value)


def _iv(d: dict | None, key: str = "value", fmt: str = ".3f") -> str:
    if not d or d.get(key) is None:
        return "—"
    if d.get("low") is None or d.get("high") is None:
        return _n(d[key], fmt)
    return f"{_n(d[key], fmt)} [{_n(d['low'], fmt)}, {_n(d['high'], fmt)}]"


def _table(columns: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows), ""]


def render_findings(facts: dict) -> str:
    """The Markdown page: formats the facts, computes nothing."""
    src, run = facts["source"], facts["run"]
    lines = ["# Findings of one PoolBench run", "",
             f"Generated by `poolbench-driver findings` from `{src['results']}` (sha256 `{src['sha256'][:16]}`, run "
             f"of {src.get('date') or '—'}, git `{str(src.get('git_hash') or '—')[:10]}`); the values are in "
             "`findings.json` beside this page. Do not edit by hand: regenerate it from the run.", "",
             "## Answer", "", *_old_answer_note(facts), *(f"- {s}" for s in facts["answer"]["sentences"]), ""]
    lines += ["## The run", "",
              f"- model: {run['model']} ({_n(run.get('n_layers'), 'd')} layers, {run.get('dtype') or '—'})",
              f"- corpus: {run.get('corpus') or '—'}, size {run.get('corpus_size') or '—'}, hash "
              f"`{run['corpus_hash'] or '—'}`; {_n(run['n_concepts'], 'd')} concepts, "
              f"{_n(run['n_train'], 'd')} train and {_n(run['n_test'], 'd')} test passages in all",
              f"- layers probed: {', '.join(str(L) for L in run['layers']) or '—'}; "
              f"{_n(run['n_strategies'], 'd')} strategies; {_n(run.get('n_bootstrap'), 'd')} bootstrap resamples; "
              f"seed {_n(run.get('seed'), 'd')}",
              "- wall time (minutes): " + (", ".join(f"{k.replace('_', ' ')} {_n(v, '.1f')}"
                                                   for k, v in run["minutes"].items()) or "—"), ""]
    mix = any(r.get("d1_mix") is not None for r in facts["leaderboard"])
    board = [[_n(r["rank"], "d"), r["strategy"], r.get("family") or "—", _n(r["layer"], "d"),
              *([_iv({"value": r.get("d1_mix"), "low": r.get("d1_mix_low"), "high": r.get("d1_mix_high")})]
                if mix else []),
              _iv({"value": r["mean_d1"], "low": r["low"], "high": r["high"]}), _n(r.get("mean_cv_auroc")),
              r.get("verdict") or "—", _n(r.get("win_rate")), f"{r['worst_concept']} {_n(r['worst_d1'])}"]
             for r in facts["leaderboard"]]
    lines += ["## Leaderboard", "",
              f"Held-out D1 (test AUROC) at each strategy's CV-chosen layer, mean over concepts with a "
              f"{run['ci_percent']}% t-interval over concepts (none below three concepts); "
              f"{facts.get('ranked_on') or 'ranked on mean held-out D1 (test AUROC)'}. The best is chosen on the "
              "mean CV AUROC, and each verdict is against it (see the Answer).", "",
              *_table(["rank", "strategy", "family", "layer", *(["D1_mix [95% CI]"] if mix else []),
                       "mean D1 [95% CI]", "mean CV", "verdict", "win rate", "worst concept"], board)]
    if facts.get("near_ties"):
        lines += ["", "Near-tied layer choices (docs/reproducibility.md):", "",
                  *[f"- {near_tie_sentence(t['strategy'], t['layer'], t)}" for t in facts["near_ties"]]]
    comparisons = facts["answer"].get("comparisons") or []
    if comparisons:
        rows = [[c["strategy"], _n(c["layer"], "d"), c["verdict"], c["test"], _n(c["mean_difference"], "+.3f"),
                 _n(c["n_concepts"], "d"), _n(c["holm_p"]), _n(c["p_rope"]),
                 f"[{c['rank_low']}, {c['rank_high']}]", _n(c.get("concepts_to_separate"), "d"),
                 _near_tie_cell(c.get("near_tie"))]
                for c in comparisons]
        lines += ["## Verdicts against the best", "",
                  f"Each strategy against {facts['answer'].get('best') or 'the best'} over concepts: Wilcoxon "
                  "signed-rank p with Holm's step-down, the Bayesian signed-rank posterior on the region of "
                  "practical equivalence, the bootstrap rank interval, and the concepts a paired t-test would need "
                  "at the observed spread; near-tie: the verdict lies within its test's tolerance of the threshold "
                  "(docs/answer.md) and reads as given across it.", "",
                  *_table(["strategy", "layer", "verdict", "test", "best − it", "concepts", "Holm p", "P(ROPE)",
                           "rank interval", "concepts to separate", "near-tie"], rows)]
    for section in facts["answer"].get("sections") or []:
        lines += [f"## {section['title']}", "", *(f"- {t}" for t in section["sentences"]), ""]
    for tier in facts.get("tiers") or []:
        rows = [[r["strategy"], _n(r.get("layer"), "d"), _iv({"value": r["auroc"], "low": r.get("ci_low"),
                                                             "high": r.get("ci_high")}),
                 _n(r.get("auroc_with_twins"))] for r in tier["rows"]]
        lexical = tier["lexical"]
        lines += [f"## The {tier['tier']} tier", "",
                  "Held-out AUROC of each strategy on this tier's test passages, best first: positives against "
                  "negatives of other pairs (95% CI over pairs), and counting each positive against its own twin"
                  + (f"; the lexical baseline's mean is {_n(lexical['mean'])}, its max {_n(lexical.get('max'))}."
                     if lexical.get("mean") is not None else "."), "",
                  *_table(["strategy", "layer", "AUROC across pairs [95% CI]", "counting own twin"], rows)]
    if facts["lexical"]:
        rows = [[r["concept"], _iv({"value": r["auroc"], "low": r["low"], "high": r["high"]}), _n(r["best_d1"])]
                for r in facts["lexical"]]
        best = facts["answer"].get("best") or (facts["leaderboard"][0]["strategy"] if facts["leaderboard"] else "best")
        lines += ["## Lexical baseline", "",
                  "A TF-IDF bag of words under the same logistic probe, per concept, beside the best strategy's D1.",
                  "", *_table(["concept", "lexical AUROC [95% CI]", f"{best} D1"], rows)]
    if facts["answer"]["steering"]:
        rows = [[c["concept"], c["strategy"], _n(c["layer"], "d"), _n(c["alpha_star"]),
                 "null" if c["delta"] is None else _iv(c["delta"], fmt="+.3f"), _iv(c["prompted"], fmt="+.3f"),
                 _n(c.get("steering_fluent")), _n(c["prompted_fluent"])] for c in facts["answer"]["steering"]]
        lines += ["## Steering against prompting", "",
                  "Δ(α*): concept-score gain over α = 0 on the held-out half of the prompts; prompted: an "
                  "instruction prefix, unsteered, on the same scorer." + _backend_caption(facts.get("steering_guard"))
                  + _guard_caption(facts.get("steering_guard")),
                  "", *_table(["concept", "strategy", "layer", "α*", "Δ(α*) [95% CI]", "prompted Δ [95% CI]",
                               "steered fluent", "prompted fluent"], rows)]
    return "\n".join(lines).rstrip() + "\n"


def write_findings(run_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    """Read a run folder, write <out>/findings.json (the facts) and <out>/findings.md (the page), atomically."""
    results_path, board_path = run_dir / "results.json", run_dir / "leaderboard.json"
    for path in (results_path, board_path):
        if not path.is_file():
            raise PoolBenchError(f"no {path.name} in {run_dir}")
    raw = results_path.read_bytes()
    try:
        results, leaderboard = json.loads(raw), json.loads(board_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise PoolBenchError(f"{run_dir}: results.json or leaderboard.json is not valid JSON ({exc})") from None
    facts = findings_facts(results, leaderboard, source=str(results_path), sha256=hashlib.sha256(raw).hexdigest(),
                           answer=run_answer(run_dir, results, leaderboard))
    page = render_findings(facts)
    facts_path, page_path = out_dir / "findings.json", out_dir / "findings.md"
    write_json_atomic(facts_path, facts)
    write_text_atomic(page_path, page)
    return page_path, facts_path
