"""The run's answer in a few sentences a person can repeat: the best strategy with its interval, whom it beats and
ties (Nemenyi), the lexical baseline beside it, steering against prompting, and a plain word when the data cannot
tell strategies apart. Built from results.json and leaderboard.json alone (a pure function), rendered for a
terminal and for the report."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from poolbench.results.ranking import MIN_CONCEPTS_FOR_INTERVAL, mean_t_interval

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
    d1: Interval  # mean held-out AUROC over concepts, t-interval over concepts
    n_concepts: int


@dataclass(frozen=True)
class Ranking:
    """Nemenyi over the Friedman average ranks results.json holds: `beats` are separated from the best, `ties`
    are within the critical difference (everyone ties when Friedman does not reject)."""

    beats: tuple[str, ...]
    ties: tuple[str, ...]
    p_value: float | None
    critical_difference: float
    alpha: float


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
class RunAnswer:
    model: str
    best: BestStrategy | None
    n_strategies: int
    ranking: Ranking | None
    ranking_missing: str | None  # why there is no Nemenyi comparison
    lexical: LexicalBeside | None
    steering: tuple[SteeringCell, ...]
    tiers: tuple[TierAnswer, ...]
    verdict: str  # "separated", "tied", "untested" or "empty"
    sentences: tuple[str, ...]


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


def _ranking(friedman: dict | None, best: str, strategies: Sequence[str]) -> tuple[Ranking | None, str | None]:
    if not friedman or not friedman.get("average_ranks") or friedman.get("critical_difference") is None:
        return None, "no Friedman/Nemenyi test in this run (it needs at least three strategies and two concepts)"
    ranks = friedman["average_ranks"]
    if best not in ranks:
        return None, f"the Friedman test did not rank {best}"
    cd, alpha, p = float(friedman["critical_difference"]), float(friedman.get("alpha", 0.05)), friedman.get("p_value")
    others = [s for s in strategies if s != best and s in ranks]
    if p is not None and float(p) >= alpha:  # no difference detected at all: Nemenyi separates nothing
        return Ranking((), tuple(others), float(p), cd, alpha), None
    beats = tuple(s for s in others if ranks[s] - ranks[best] > cd)
    ties = tuple(s for s in others if s not in beats)
    return Ranking(beats, ties, None if p is None else float(p), cd, alpha), None


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
        fluent = None if guard is None or ratio is None else float(ratio) <= float(guard)
        cells.append(SteeringCell(
            r["concept"], r["strategy"], int(r["layer"]), r.get("alpha_star"),
            _ci(r, "d2_delta") if r.get("status") == "ok" else None, _ci(r, "prompted_delta"), fluent,
            r.get("null_reason") or r.get("vector_null_reason")))
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


def build_answer(results: dict, leaderboard: dict) -> RunAnswer:
    """The answer for one run, from its two documents; every number in it is read or computed from them."""
    model = str((results.get("model") or {}).get("model_id") or "?")
    rows = sorted(leaderboard.get("strategies") or [], key=lambda r: r["rank"])
    steering = _steering(results)
    if not rows:
        return RunAnswer(model, None, 0, None, "no D1 cells", None, steering, (), "empty",
                         (f"{model}: no D1 cells, so no strategy to recommend.",))
    top = rows[0]
    mean, low, high = mean_t_interval([v["auroc"] for v in top["per_concept"].values()])
    best = BestStrategy(top["strategy"], int(top["best_layer"]), Interval(mean, low, high), len(top["per_concept"]))
    friedman = (results.get("reliability") or {}).get("friedman") or leaderboard.get("friedman")
    ranking, missing = _ranking(friedman, best.strategy, [r["strategy"] for r in rows])
    lexical = _lexical(results, top)
    tiers = _tiers(leaderboard)

    interval = _interval_text(best.d1)
    if best.d1.low is None:
        interval += f": fewer than {MIN_CONCEPTS_FOR_INTERVAL} concepts"
    sentences = [f"Best on {model}: {best.strategy} at layer {best.layer}, mean D1 {interval} over "
                 f"{_plural(best.n_concepts, 'concept')} ({len(rows)} strategies run)."]
    if leaderboard.get("protocol") == "pb":
        sentences.append("D1 is the official leaderboard's protocol (pb): the out-of-fold DiffMean AUROC of the "
                         "train split; there is no held-out test, so this answer is cross-validated only.")
    if ranking is None:
        verdict = "untested"
        sentences.append(f"Which strategies it beats is not tested: {missing}.")
    else:
        test = (f"Nemenyi, CD {ranking.critical_difference:.2f} ranks"
                + ("" if ranking.p_value is None else f", Friedman p = {ranking.p_value:.3g}"))
        if ranking.beats:
            sentences.append(f"It beats {_plural(len(ranking.beats), 'strategy', 'strategies')} "
                             f"({test}): {_names(ranking.beats)}.")
        if ranking.ties:
            sentences.append(f"It ties {len(ranking.ties)}: {_names(ranking.ties)}"
                             + ("." if ranking.beats else f" ({test})."))
        verdict = "tied" if ranking.ties else "separated"
    if lexical is not None:
        sentences.append(f"Lexical baseline (bag of words, no model): mean {_interval_text(lexical.mean)}; "
                         f"1.000 on {lexical.n_ceiling} of {lexical.n_concepts} concepts, at or above "
                         f"{best.strategy} on {lexical.n_at_least_best}.")
    sentences += [_tier_sentence(t) for t in tiers]
    if steering:
        sentences.append(_steering_sentence(steering))
    if verdict == "tied" and ranking is not None:
        n = len(ranking.ties)
        head = (f"{n} {'strategy is' if n == 1 else 'strategies are'} statistically tied with the best"
                if ranking.beats else f"The data cannot tell any of the {len(rows)} strategies apart")
        if lexical is not None and 2 * lexical.n_ceiling >= lexical.n_concepts:
            sentences.append(f"{head}; the lexical baseline scores 1.000 on {lexical.n_ceiling} of "
                             f"{lexical.n_concepts} concepts, so this corpus cannot separate them.")
        else:
            sentences.append(f"{head}: this run cannot separate them.")
    elif verdict == "separated":
        sentences.append(f"{best.strategy} is ahead of every other strategy at Nemenyi's critical difference.")
    return RunAnswer(model, best, len(rows), ranking, missing, lexical, steering, tiers, verdict, tuple(sentences))


def answer_text(answer: RunAnswer) -> str:
    """Plain lines for a terminal or a CI log: the sentences, then one line per steering cell."""
    lines = ["Answer", *answer.sentences]
    for c in answer.steering:
        if c.delta is None:
            lines.append(f"  {c.concept} / {c.strategy} L{c.layer}: null steering vector ({c.null_reason or '?'})")
            continue
        prompted = "" if c.prompted is None else f"; prompted Δ {_interval_text(c.prompted, signed=True)}" + (
            "" if c.prompted_fluent is not False else " (fails the fluency guard)")
        lines.append(f"  {c.concept} / {c.strategy} L{c.layer}: α* {_f(c.alpha_star)}, "
                     f"Δ(α*) {_interval_text(c.delta, signed=True)}{prompted}")
    return "\n".join(lines)


def answer_html(answer: RunAnswer) -> str:
    """The same answer as a block at the top of the report."""
    sentences = "".join(f"<p>{html.escape(s)}</p>" for s in answer.sentences)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in (
            c.concept, c.strategy, str(c.layer), _f(c.alpha_star),
            "null" if c.delta is None else _interval_text(c.delta, signed=True),
            _interval_text(c.prompted, signed=True),
            {True: "yes", False: "no", None: "—"}[c.prompted_fluent])) + "</tr>" for c in answer.steering)
    table = ("" if not rows else '<table class="answer"><thead><tr><th>concept</th><th>strategy</th><th>layer</th>'
             "<th>α*</th><th>steering Δ(α*) [95% CI]</th><th>prompted Δ [95% CI]</th><th>prompted fluent</th>"
             f"</tr></thead><tbody>{rows}</tbody></table>")
    return f'<div class="answer" data-verdict="{answer.verdict}"><h3>Answer</h3>{sentences}{table}</div>'
