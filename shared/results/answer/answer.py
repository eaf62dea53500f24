"""The run's answer in a few sentences a person can repeat: the best strategy, chosen on training CV before the
held-out test is looked at, and whether the test confirms it; one verdict per other strategy against it, with the
test behind it (poolbench.prober.verdicts); the confidence set for the best and how many concepts would separate
it; the lexical baseline beside it; steering against prompting. Built from results.json, leaderboard.json and the
per-passage score table once, written to answer.json, and rendered from answer.json for the terminal, the report
and the findings page."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
from pydantic import TypeAdapter, ValidationError

from poolbench.atomic_write import write_text_atomic
from poolbench.errors import PoolBenchError
from poolbench.prober.auroc import ProbeError
from poolbench.prober.passage_scores import held_out_cells
from poolbench.prober.verdicts import DEFAULT_ROPE, compare_strategies
from poolbench.records.d1 import cv_best_row
from poolbench.records.verdicts import WORSE, StrategyVerdicts
from poolbench.results.answer.answer_verdicts import choice_sentence, comparison_line, near_tie_text, verdict_sentences
from poolbench.results.answer.leaderboard import RANKED_ON_BLEND, RANKED_ON_MIX
from poolbench.results.answer.ranking import MIN_CONCEPTS_FOR_INTERVAL, mean_t_interval
from poolbench.results.answer.steerability_answer import SteerabilityAnswer, steerability_answer
from poolbench.results.answer.tier_estimand import estimand_sentence

ANSWER_FILE = "answer.json"
ANSWER_VERSION = 1

# A lexical AUROC that prints as 1.000 is at the ceiling: the words alone separate the concept.
LEXICAL_CEILING = 0.9995


@dataclass(frozen=True)
class Interval:
    """A value with its 95% interval; low/high are None where no honest interval exists (too few units)."""

    value: float
    low: float | None = None
    high: float | None = None

    def above(self, point: float) -> bool:
        return self.low is not None and self.low > point


@dataclass(frozen=True)
class BestStrategy:
    strategy: str
    layer: int
    d1: Interval  # mean held-out AUROC over concepts, t-interval over concepts (with tiers: their blend)
    n_concepts: int
    d1_mix: Interval | None = None  # the declared tier estimand's mean over concepts, when the run is ranked on it


@dataclass(frozen=True)
class LexicalBeside:
    """The bag-of-words baseline (no model) against the best strategy, concept by concept."""

    mean: Interval
    n_ceiling: int  # concepts where the words alone score 1.000
    n_at_least_best: int  # concepts where the words match or beat the best strategy's D1
    n_concepts: int


@dataclass(frozen=True)
class SteeringCell:
    concept: str
    strategy: str
    layer: int
    alpha_star: float | None
    delta: Interval | None  # Delta(alpha*) on the held-out half; None for a null steering vector
    prompted: Interval | None  # the instruction prefix, unsteered, on the same scorer
    prompted_fluent: bool | None  # the prompted text passes the fluency guard steering must pass
    null_reason: str | None = None
    steering_fluent: bool | None = None  # the steered text at alpha* passes that same guard (D2 v4 records)


@dataclass(frozen=True)
class TierAnswer:
    """One corpus tier (leaderboard.json's by_tier): its best strategy and how many others its interval clears."""

    tier: str
    strategy: str | None
    layer: int | None
    auroc: Interval | None
    n_excluded: int
    n_others: int
    separates: bool
    lexical_mean: float | None
    lexical_max: float | None


@dataclass(frozen=True)
class AnswerSection:
    """A part of the answer another stage adds (the D1-steerability correlation, a validation): a key, a title,
    its sentences as printed, and its numbers by name, so a reader of answer.json needs no parsing of prose."""

    key: str
    title: str
    sentences: tuple[str, ...]
    values: dict[str, float | int | str | bool | None] = field(default_factory=dict)


@dataclass(frozen=True)
class RunAnswer:
    model: str
    best: BestStrategy | None
    n_strategies: int
    verdicts: StrategyVerdicts | None  # the CV-chosen best and every other strategy's verdict against it
    verdicts_missing: str | None  # why there are no verdicts
    lexical: LexicalBeside | None
    steering: tuple[SteeringCell, ...]
    tiers: tuple[TierAnswer, ...]
    verdict: str  # "separated" (every other strategy worse), "set", "untested" or "empty"
    sentences: tuple[str, ...]
    sections: tuple[AnswerSection, ...] = ()
    version: int = ANSWER_VERSION
    steerability: SteerabilityAnswer | None = None  # Spearman(D1, first-order steerability), its validation
    ranked_on: str = RANKED_ON_BLEND  # what the ordering and the verdicts compare: the estimand or the blend


def _f(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def _interval_text(iv: Interval | None, signed: bool = False) -> str:
    if iv is None:
        return "n/a"
    if iv.low is None or iv.high is None:
        return f"{_f(iv.value, signed)} (no interval)"
    return f"{_f(iv.value, signed)} [{_f(iv.low, signed)}, {_f(iv.high, signed)}]"


def _names(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else many or word + 's'}"


def _lexical(results: dict, best_row: dict) -> LexicalBeside | None:
    rows = [r for r in results.get("lexical_baseline") or [] if r.get("test_auroc") is not None]
    if not rows:
        return None
    values = [float(r["test_auroc"]) for r in rows]
    mean, low, high = mean_t_interval(values)
    best_by = {c: v["auroc"] for c, v in best_row["per_concept"].items()}
    at_least = sum(1 for r in rows if r["concept"] in best_by and float(r["test_auroc"]) >= best_by[r["concept"]])
    return LexicalBeside(Interval(mean, low, high), sum(1 for v in values if v >= LEXICAL_CEILING), at_least,
                         len(rows))


def _ci(record: dict, key: str) -> Interval | None:
    value = record.get(key)
    if value is None:
        return None
    return Interval(float(value), record.get(f"{key}_ci_low"), record.get(f"{key}_ci_high"))


def _steering(results: dict) -> tuple[SteeringCell, ...]:
    d2 = results.get("d2") or (results.get("steering") or {}).get("d2") or []
    cells = []
    for r in sorted(d2, key=lambda r: (r["concept"], r["strategy"], r["layer"])):
        guard, ratio = r.get("fluency_guard"), r.get("prompted_fluency_ratio")
        fluent = r.get("prompted_passes_fluency_guard")  # D2 v4: reference perplexity and distinct-2, as steering
        if fluent is None and "reference_model" not in r:  # older runs recorded the perplexity ratio alone
            fluent = None if guard is None or ratio is None else float(ratio) <= float(guard)
        cells.append(SteeringCell(
            r["concept"], r["strategy"], int(r["layer"]), r.get("alpha_star"),
            _ci(r, "d2_delta") if r.get("status") == "ok" else None, _ci(r, "prompted_delta"), fluent,
            r.get("null_reason") or r.get("vector_null_reason"), r.get("passes_fluency_guard")))
    return tuple(cells)


def _tiers(leaderboard: dict) -> tuple[TierAnswer, ...]:
    out = []
    for tier, section in (leaderboard.get("by_tier") or {}).items():
        rows = section.get("rows") or []
        top = rows[0] if rows else None
        lexical = section.get("lexical") or {}
        out.append(TierAnswer(
            tier, None if top is None else top["strategy"], None if top is None else top.get("layer"),
            None if top is None else Interval(float(top["auroc"]), top.get("ci_low"), top.get("ci_high")),
            int(section.get("n_excluded_by_best") or 0), int(section.get("n_others") or 0),
            bool(section.get("separates")), lexical.get("mean"), lexical.get("max")))
    return tuple(out)


def _tier_sentence(t: TierAnswer) -> str:
    lexical = "" if t.lexical_mean is None else (f"; lexical baseline mean {_f(t.lexical_mean)}, max "
                                                 f"{_f(t.lexical_max)}")
    if t.strategy is None:
        return f"On the {t.tier} tier no strategy was scored{lexical}."
    return (f"On the {t.tier} tier: best {t.strategy} at layer {t.layer}, AUROC {_interval_text(t.auroc)}; its "
            f"interval lies above {t.n_excluded} of {t.n_others} others, so this tier "
            f"{'separates' if t.separates else 'does not separate'} the strategies{lexical}.")


def _steering_sentence(cells: Sequence[SteeringCell]) -> str:
    ok = [c for c in cells if c.delta is not None]
    steer_moves = sum(1 for c in ok if c.delta is not None and c.delta.above(0.0))
    prompted = {c.concept: c for c in cells if c.prompted is not None}
    prompt_moves = sum(1 for c in prompted.values() if c.prompted is not None and c.prompted.above(0.0))
    unfluent = sorted(c for c, cell in prompted.items() if cell.prompted_fluent is False)
    sentence = (f"Steering: Δ(α*) on the held-out prompts lies above 0 (its 95% CI) in {steer_moves} of "
                f"{_plural(len(ok), 'cell')}"
                + (f" ({len(cells) - len(ok)} null)" if len(cells) > len(ok) else "")
                + f"; the prompted baseline's Δ does in {prompt_moves} of {_plural(len(prompted), 'concept')}")
    if unfluent:
        sentence += f" (prompted text fails the fluency guard on {', '.join(unfluent)})"
    return sentence + "."


def _verdicts(results: dict, leaderboard: dict, rows: list[dict], passage_scores: pa.Table | None
              ) -> tuple[StrategyVerdicts | None, str | None]:
    if len(rows) < 2:
        return None, "one strategy, nothing to compare it with"
    config = results.get("config") or {}
    measure = "d1_mix" if leaderboard.get("ranked_on") == RANKED_ON_MIX else "auroc"
    test = {r["strategy"]: {c: v[measure] for c, v in r["per_concept"].items() if v.get(measure) is not None}
            for r in rows}
    cv = {r["strategy"]: {c: v.get("cv_auroc", v["auroc"]) for c, v in r["per_concept"].items()} for r in rows}
    layers = {r["strategy"]: int(r["best_layer"]) for r in rows}
    held_out = None if passage_scores is None else held_out_cells(passage_scores, layers,
                                                                  str(leaderboard.get("probe", "logistic")))
    try:
        return compare_strategies(test, cv, layers, held_out=held_out, rope=float(config.get("rope") or DEFAULT_ROPE),
                                  n_bootstrap=int(config.get("n_bootstrap") or 1000) or 1000,
                                  seed=int(config.get("seed") or 0),
                                  measure=RANKED_ON_MIX if measure == "d1_mix" else RANKED_ON_BLEND), None
    except ProbeError as exc:
        return None, str(exc).removeprefix("compare_strategies: ")


def build_answer(results: dict, leaderboard: dict, passage_scores: pa.Table | None = None,
                 sections: Sequence[AnswerSection] = ()) -> RunAnswer:
    """The answer for one run, from its two documents and its per-passage score table (without it, no paired
    bootstrap over matched pairs); every number in it is read or computed from them, never refitted."""
    model = str((results.get("model") or {}).get("model_id") or "?")
    rows = sorted(leaderboard.get("strategies") or [], key=lambda r: r["rank"])
    steering = _steering(results)
    if not rows:
        return RunAnswer(model, None, 0, None, "no D1 cells", None, steering, (), "empty",
                         (f"{model}: no D1 cells, so no strategy to recommend.",), tuple(sections))
    verdicts, missing = _verdicts(results, leaderboard, rows, passage_scores)
    chosen = verdicts.best.strategy if verdicts is not None else cv_best_row(rows)["strategy"]
    top = next(r for r in rows if r["strategy"] == chosen)
    mean, low, high = mean_t_interval([v["auroc"] for v in top["per_concept"].values()])
    ranked_on = RANKED_ON_MIX if leaderboard.get("ranked_on") == RANKED_ON_MIX else RANKED_ON_BLEND
    mix = None if ranked_on == RANKED_ON_BLEND else Interval(float(top["d1_mix"]), top.get("d1_mix_ci_low"),
                                                             top.get("d1_mix_ci_high"))
    best = BestStrategy(top["strategy"], int(top["best_layer"]), Interval(mean, low, high), len(top["per_concept"]),
                        mix)
    lexical = _lexical(results, top)
    tiers = _tiers(leaderboard)

    interval = _interval_text(best.d1)
    if best.d1.low is None:
        interval += f": fewer than {MIN_CONCEPTS_FOR_INTERVAL} concepts"
    cv_mean = top.get("mean_cv_auroc")
    if leaderboard.get("protocol") == "pb":
        sentences = [f"Best on {model}: {best.strategy} at layer {best.layer}, mean D1 {interval} over "
                     f"{_plural(best.n_concepts, 'concept')} ({len(rows)} strategies run).",
                     "D1 is the official leaderboard's protocol (pb): the out-of-fold DiffMean AUROC of the "
                     "train split; there is no held-out test, so this answer is cross-validated only."]
    else:
        sentences = [f"Best on {model}, chosen on the training CV alone: {best.strategy} at layer {best.layer}"
                     + ("" if cv_mean is None else f", mean CV AUROC {cv_mean:.3f}")
                     + f"; held-out mean D1 {interval} over {_plural(best.n_concepts, 'concept')} "
                     f"({len(rows)} strategies run)."]
    if best.d1_mix is not None:
        sentences.append(f"Held-out on the declared estimand, D1_mix {_interval_text(best.d1_mix)} over "
                         f"{_plural(int(top['d1_mix_concepts']), 'concept')}: the leaderboard's order and the "
                         "verdicts below compare D1_mix; mean D1 above is the overall held-out AUROC, which blends "
                         "the tiers at the test split's own mix.")
    if estimand := estimand_sentence(leaderboard.get("estimand") or {}):
        sentences.append(estimand)
    if verdicts is None:
        verdict = "untested"
        sentences.append(f"Which strategies it is ahead of is not tested: {missing}.")
    else:
        sentences += [choice_sentence(verdicts), *verdict_sentences(verdicts)]
        verdict = "separated" if all(c.verdict == WORSE for c in verdicts.comparisons) else "set"
    if lexical is not None:
        sentences.append(f"Lexical baseline (bag of words, no model): mean {_interval_text(lexical.mean)}; "
                         f"1.000 on {lexical.n_ceiling} of {lexical.n_concepts} concepts, at or above "
                         f"{best.strategy} on {lexical.n_at_least_best}.")
    sentences += [_tier_sentence(t) for t in tiers]
    if steering:
        sentences.append(_steering_sentence(steering))
    steerable = steerability_answer(results)
    if steerable is not None:
        sentences.append(steerable.sentence)
    if verdict == "set" and verdicts is not None:
        n = len(verdicts.confidence_set)
        head = (f"The answer is a set, not a winner: {_plural(n, 'strategy', 'strategies')} in the confidence set "
                f"for the best" if n > 1 else f"No strategy but {best.strategy} reaches rank 1, yet not every other "
                "is separated from it")
        if lexical is not None and 2 * lexical.n_ceiling >= lexical.n_concepts:
            sentences.append(f"{head}; the lexical baseline scores 1.000 on {lexical.n_ceiling} of "
                             f"{lexical.n_concepts} concepts, so this corpus cannot separate them.")
        else:
            sentences.append(f"{head}.")
    elif verdict == "separated":
        sentences.append(f"{best.strategy} is ahead of every other strategy (Wilcoxon signed-rank, Holm).")
    return RunAnswer(model, best, len(rows), verdicts, missing, lexical, steering, tiers, verdict, tuple(sentences),
                     tuple(sections), steerability=steerable, ranked_on=ranked_on)


_ADAPTER = TypeAdapter(RunAnswer)


def answer_json(answer: RunAnswer) -> str:
    return _ADAPTER.dump_json(answer, indent=2).decode()


def write_answer(answer: RunAnswer, path: Path) -> None:
    """answer.json, atomically: the one source the printed answer, the report and the findings render."""
    write_text_atomic(path, answer_json(answer) + "\n")


def read_answer(path: Path) -> RunAnswer:
    """A stored answer.json as its typed record; a malformed one stops in one line naming the file."""
    try:
        return _ADAPTER.validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValidationError, ValueError) as exc:
        first = exc.errors()[0] if isinstance(exc, ValidationError) else None
        where = "" if first is None else f" at {'.'.join(str(x) for x in first['loc'])}: {first['msg']}"
        raise PoolBenchError(f"{path}: not a PoolBench answer{where or f' ({exc})'}") from None


def run_answer(run_dir: Path, results: dict, leaderboard: dict) -> RunAnswer:
    """The run folder's answer.json, or, for a run written before answers were stored, one built from its two
    documents (and its per-passage scores when the folder has them)."""
    path = run_dir / ANSWER_FILE
    if path.is_file():
        return read_answer(path)
    from poolbench.results.answer.passage_table import read_run_scores

    return build_answer(results, leaderboard, read_run_scores(run_dir))


def answer_text(answer: RunAnswer) -> str:
    """Plain lines for a terminal or a CI log: the sentences, one line per verdict, one per steering cell, then
    each added section."""
    lines = ["Answer", *answer.sentences]
    if answer.verdicts is not None:
        lines += [comparison_line(c) for c in answer.verdicts.comparisons]
    for c in answer.steering:
        if c.delta is None:
            lines.append(f"  {c.concept} / {c.strategy} L{c.layer}: null steering vector ({c.null_reason or '?'})")
            continue
        prompted = "" if c.prompted is None else f"; prompted Δ {_interval_text(c.prompted, signed=True)}" + (
            "" if c.prompted_fluent is not False else " (fails the fluency guard)")
        lines.append(f"  {c.concept} / {c.strategy} L{c.layer}: α* {_f(c.alpha_star)}, "
                     f"Δ(α*) {_interval_text(c.delta, signed=True)}{prompted}")
    for section in answer.sections:
        lines += [section.title, *section.sentences]
    return "\n".join(lines)


def answer_html(answer: RunAnswer) -> str:
    """The same answer as a block at the top of the report."""
    sentences = "".join(f"<p>{html.escape(s)}</p>" for s in answer.sentences)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in (
            c.concept, c.strategy, str(c.layer), _f(c.alpha_star),
            "null" if c.delta is None else _interval_text(c.delta, signed=True),
            _interval_text(c.prompted, signed=True), {True: "yes", False: "no", None: "—"}[c.steering_fluent],
            {True: "yes", False: "no", None: "—"}[c.prompted_fluent])) + "</tr>" for c in answer.steering)
    table = ("" if not rows else '<table class="answer"><thead><tr><th>concept</th><th>strategy</th><th>layer</th>'
             "<th>α*</th><th>steering Δ(α*) [95% CI]</th><th>prompted Δ [95% CI]</th><th>steered fluent</th>"
             "<th>prompted fluent</th>"
             f"</tr></thead><tbody>{rows}</tbody></table>")
    verdicts = "" if answer.verdicts is None else (
        '<table class="verdicts"><thead><tr><th>strategy</th><th>layer</th><th>verdict</th><th>test</th>'
        "<th>best − it</th><th>n</th><th>Wilcoxon p</th><th>Holm p</th><th>P(ROPE)</th><th>rank interval</th>"
        "<th>near-tie</th></tr></thead><tbody>" + "".join(
            "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in (
                c.strategy, str(c.layer), c.verdict, c.test, f"{c.mean_difference:+.3f}", str(c.n_concepts),
                _f(c.wilcoxon_p), _f(c.holm_p), f"{c.p_rope:.3f}", f"[{c.rank_low}, {c.rank_high}]",
                near_tie_text(c).removeprefix("near-tie: ") or "—")) + "</tr>"
            for c in answer.verdicts.comparisons) + "</tbody></table>")
    extra = "".join(f"<h4>{html.escape(x.title)}</h4>" + "".join(f"<p>{html.escape(t)}</p>" for t in x.sentences)
                    for x in answer.sections)
    return (f'<div class="answer" data-verdict="{answer.verdict}"><h3>Answer</h3>{sentences}{verdicts}{table}'
            f"{extra}</div>")
