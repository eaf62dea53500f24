"""The answer's "does the best probe steer best?": Spearman(D1, first-order steerability) with its interval, from
results.json's steerability section, and whether `make run-steerability` found the cheap measure may stand in for
D2 on this model (it is only a likelihood proxy until validated, and the answer says which)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SteerabilityAnswer:
    mean_rho: float | None
    low: float | None
    high: float | None
    n_concepts: int
    stands_in: bool | None  # the validation's verdict for this model's weights; None: not validated here
    validation: str | None  # the validation's own sentence

    @property
    def sentence(self) -> str:
        if self.mean_rho is None:
            head = "Whether the best probe steers best is not measured (no concept has first-order steerability " \
                   "on 3 or more strategies)."
        else:
            interval = (f", 95% CI {self.low:+.2f} to {self.high:+.2f} over concepts" if self.low is not None
                        and self.high is not None else ", too few concepts for an interval")
            head = (f"Does the best probe steer best? Spearman(D1, first-order steerability) across strategies is "
                    f"{self.mean_rho:+.2f} ({self.n_concepts} concepts{interval}).")
        if self.stands_in is None:
            return head + " First-order steerability is a likelihood proxy, not validated against D2 for this " \
                          "model (make run-steerability)."
        if not self.stands_in:
            return head + " It may NOT stand in for D2 here (make run-steerability: " + (self.validation or "") + ")"
        return head + " make run-steerability found it may stand in for D2 on this model."


def steerability_answer(results: dict) -> SteerabilityAnswer | None:
    """From results.json; None where the run measured no steerability (no S2 in the run)."""
    section = results.get("steerability")
    if not isinstance(section, dict):
        return None
    agreement = section.get("agreement") or {}
    validation = section.get("validation")
    stands_in = validation.get("stands_in") if isinstance(validation, dict) else None
    return SteerabilityAnswer(agreement.get("mean_rho"), agreement.get("low"), agreement.get("high"),
                              int(agreement.get("n_concepts") or 0),
                              None if stands_in is None else bool(stands_in),
                              validation.get("sentence") if isinstance(validation, dict) else None)
