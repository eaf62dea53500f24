"""What steering costs on another task: lm-evaluation-harness's `local-completions` model scores a task through the
service's OpenAI-compatible endpoint once unsteered (alpha = 0) and once at the cell's alpha*, and the per-document
difference of the task's metric gets a paired bootstrap interval (documents resampled, both arms together)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from poolbench.errors import PoolBenchError


class CapabilityError(PoolBenchError):
    """A capability task that cannot be run or scored."""


@dataclass(frozen=True)
class CapabilityRecord:
    """The task's metric with and without steering on the same documents, and their paired difference."""

    task: str
    metric: str
    concept: str
    strategy: str
    layer: int
    alpha: float
    n_docs: int
    score_unsteered: float
    score_steered: float
    difference: float  # steered - unsteered; negative: steering costs capability
    ci_low: float
    ci_high: float
    n_bootstrap: int

    def to_dict(self) -> dict:
        return asdict(self)


def paired_difference(steered: np.ndarray, unsteered: np.ndarray, *, n_bootstrap: int = 2000, seed: int = 0,
                      ) -> tuple[float, float, float]:
    """Mean of steered - unsteered over documents and its 95% percentile bootstrap interval, documents resampled
    with both arms (scipy.stats.bootstrap, paired)."""
    from scipy.stats import bootstrap

    a, b = np.asarray(steered, np.float64), np.asarray(unsteered, np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        raise CapabilityError(f"capability: {a.shape} steered and {b.shape} unsteered scores; need the same >= 2 docs")
    diff = a - b
    if np.all(diff == diff[0]):  # every resample has this mean: the interval is the point
        return float(diff[0]), float(diff[0]), float(diff[0])
    res = bootstrap((a, b), lambda x, y: np.mean(x - y), paired=True, vectorized=False, n_resamples=n_bootstrap,
                    confidence_level=0.95, method="percentile", rng=np.random.default_rng(seed))
    return float(diff.mean()), float(res.confidence_interval.low), float(res.confidence_interval.high)


def defines_task(task_dir: Path, task: str) -> bool:
    """Whether a YAML in `task_dir` names `task` (then lm-eval's thousands of built-in tasks need no indexing)."""
    line = re.compile(rf"^task:\s*['\"]?{re.escape(task)}['\"]?\s*$", re.MULTILINE)
    return any(line.search(p.read_text(errors="replace")) for p in Path(task_dir).glob("*.y*ml"))


def lm_eval_scores(base_url: str, model: str, tokenizer: str, task: str, task_dir: Path, metric: str, *,
                   steering: dict | None, token: str | None = None, limit: int | None = None) -> dict[int, float]:
    """The task's per-document `metric` from lm-evaluation-harness's local-completions model against
    `base_url`/v1/completions, steered through the X-PoolBench-Steering header (None: unsteered)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    header = {"Authorization": f"Bearer {token or 'none'}"}
    if steering is not None:
        header["X-PoolBench-Steering"] = json.dumps(steering)
    try:
        out = simple_evaluate(
            model="local-completions", tasks=[task],
            task_manager=TaskManager(include_path=str(task_dir), include_defaults=not defines_task(task_dir, task)),
            model_args={"model": model, "base_url": f"{base_url}/v1/completions", "tokenizer": tokenizer,
                        "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1,
                        "max_retries": 1, "header": header},
            limit=limit, log_samples=True, bootstrap_iters=0)
    except Exception as exc:  # lm-eval raises plain exceptions for a missing task or an unreachable endpoint
        raise CapabilityError(f"capability task '{task}' ({task_dir}): {str(exc).splitlines()[0]}") from exc
    if out is None or task not in (out.get("samples") or {}):
        raise CapabilityError(f"capability task '{task}' ({task_dir}): lm-eval returned no samples")
    samples = out["samples"][task]
    missing = [s["doc_id"] for s in samples if metric not in s]
    if missing:
        raise CapabilityError(f"capability task '{task}': no metric '{metric}' for doc {missing[0]}")
    return {int(s["doc_id"]): float(s[metric]) for s in samples}


def measure_capability(base_url: str, model: str, tokenizer: str, task: str, task_dir: Path, *, concept: str,
                       strategy: str, layer: int, alpha: float, metric: str = "acc", token: str | None = None,
                       limit: int | None = None, n_bootstrap: int = 2000, seed: int = 0) -> CapabilityRecord:
    """The task at alpha = 0 and at `alpha` with the run's stored (concept, strategy, layer) vector."""
    steering = {"concept": concept, "strategy": strategy, "layer": layer, "alpha": alpha}
    zero = lm_eval_scores(base_url, model, tokenizer, task, task_dir, metric, steering=None, token=token, limit=limit)
    steered = lm_eval_scores(base_url, model, tokenizer, task, task_dir, metric, steering=steering, token=token,
                             limit=limit)
    docs = sorted(zero)
    a, b = np.array([steered[d] for d in docs]), np.array([zero[d] for d in docs])
    diff, low, high = paired_difference(a, b, n_bootstrap=n_bootstrap, seed=seed)
    return CapabilityRecord(task, metric, concept, strategy, layer, float(alpha), len(docs), float(b.mean()),
                            float(a.mean()), diff, low, high, n_bootstrap)
