"""`run --capability-task`: the task checked before any work, the run's steered cells (each at its alpha*), and the
capability records written where a run's readers look: capability.json, results.json's `capability`, and a section
of answer.json (which the printed answer, the report and the findings page render)."""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
from pathlib import Path

from poolbench.atomic_write import write_json_atomic
from poolbench.capability.measure import CapabilityError, CapabilityRecord, defines_task
from poolbench.results.answer.answer import AnswerSection, read_answer, write_answer

CAPABILITY_FILE = "capability.json"


def _task_yaml(path: Path) -> object:
    """A task YAML as data; the tags only lm-eval resolves (`!function utils.process`) read as None (PyYAML comes
    with lm-eval)."""
    import yaml

    class TaskLoader(yaml.SafeLoader):
        pass

    TaskLoader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        return yaml.load(path.read_text(errors="replace"), Loader=TaskLoader)
    except yaml.YAMLError as exc:
        raise CapabilityError(f"{path}: not YAML ({str(exc).splitlines()[0]})") from None


def _data_files(config: dict) -> list[str]:
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        files = list(files.values())
    out: list[str] = []
    for item in files if isinstance(files, list) else [files] if files else []:
        out += item if isinstance(item, list) else [item]
    return [str(f) for f in out]


def check_capability_task(task: str, task_dir: Path, *, steering: bool) -> None:
    """One line, before any model loads, for what would stop the capability stage after the run: no steering, no
    lm-eval, no task folder, no YAML there naming the task, or a local data file it names missing."""
    if not steering:
        raise CapabilityError("--capability-task: needs the steering stage (its alpha*); drop --no-steering")
    if importlib.util.find_spec("lm_eval") is None:
        raise CapabilityError("--capability-task needs lm-eval: pip install 'lm-eval[api]'")
    if not task_dir.is_dir():
        raise CapabilityError(f"--capability-task-dir: {task_dir} is not a folder")
    if not defines_task(task_dir, task):
        raise CapabilityError(f"--capability-task: no YAML in {task_dir} defines task '{task}' (a line 'task: {task}')")
    for path in sorted(task_dir.glob("*.y*ml")):
        config = _task_yaml(path)
        if not isinstance(config, dict) or config.get("task") != task:
            continue
        for name in _data_files(config):
            if not any(glob.glob(str(p)) for p in (Path(name), task_dir / name)):
                raise CapabilityError(f"{path}: dataset_kwargs.data_files: {name} does not exist")


def steered_cells(doc: dict) -> list[tuple[str, str, int, float]]:
    """(concept, strategy, layer, alpha*) of every D2 cell with a steering vector and an alpha* > 0, once each."""
    cells = {(r["concept"], r["strategy"], int(r["layer"])): float(r["alpha_star"]) for r in doc.get("d2") or []
             if r.get("alpha_star")}
    return [(*key, alpha) for key, alpha in sorted(cells.items())]


def _key(r: dict) -> tuple:
    return r["task"], r["concept"], r["strategy"], r["layer"], r["alpha"]


def merged(kept: list[dict], records: list[CapabilityRecord]) -> list[dict]:
    """The kept records with these added, one per (task, concept, strategy, layer, alpha): a rerun replaces its own."""
    new = [r.to_dict() for r in records]
    ours = {_key(r) for r in new}
    return [r for r in kept if _key(r) not in ours] + new


def record_sentence(r: dict) -> str:
    moved = ("a cost" if r["ci_high"] < 0 else "a gain" if r["ci_low"] > 0 else "no difference the interval separates")
    return (f"{r['task']} {r['metric']} steered by {r['concept']}/{r['strategy']} L{r['layer']} at α {r['alpha']:g}: "
            f"{r['score_steered']:.3f} against {r['score_unsteered']:.3f} unsteered, difference {r['difference']:+.3f} "
            f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] over {r['n_docs']} documents ({moved}).")


def capability_section(records: list[dict]) -> AnswerSection:
    """What steering costs on the capability task(s): one sentence per record, its numbers by name."""
    values: dict[str, float | int | str | bool | None] = {}
    for r in records:
        at = f"{r['task']}/{r['concept']}/{r['strategy']}/L{r['layer']}/alpha={r['alpha']:g}"
        values.update({f"{at}/{k}": r[k] for k in ("score_unsteered", "score_steered", "difference", "ci_low",
                                                    "ci_high", "n_docs")})
    return AnswerSection("capability", "What steering costs (lm-evaluation-harness, steered - unsteered, 95% paired "
                         "bootstrap interval)", tuple(record_sentence(r) for r in records), values)


def record_capability(run_dir: Path, records: list[CapabilityRecord], stamped: tuple[Path, ...] = ()) -> list[dict]:
    """capability.json, results.json's `capability` and answer.json's capability section (and the run's stamped
    copies in `stamped`) hold these records with those kept from before (answer.json where the run has one);
    returns them all."""
    target = run_dir / CAPABILITY_FILE
    kept = merged(json.loads(target.read_text()) if target.is_file() else [], records)
    write_json_atomic(target, kept)
    for path in (run_dir / "results.json", *[p for p in stamped if p.name.startswith("results_")]):
        doc = json.loads(path.read_text())
        write_json_atomic(path, {**doc, "capability": merged(doc.get("capability") or [], records)})
    section = capability_section(kept)
    for path in (run_dir / "answer.json", *[p for p in stamped if p.name.startswith("answer_")]):
        if not path.is_file():  # a run written before answers were stored: findings builds its answer anew
            continue
        answer = read_answer(path)
        sections = (*[s for s in answer.sections if s.key != "capability"], section)
        write_answer(dataclasses.replace(answer, sections=sections), path)
    return kept
