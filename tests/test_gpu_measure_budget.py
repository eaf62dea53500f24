"""bench/gpu_measure.sh keeps inside its BUDGET: the device tool kills a call at 600 s without a signal the steps
could act on (scale.py writes its JSON on SIGINT), so each step's limit is cut to what is left and a step with too
little left is skipped, said so in gpu.log. The steps here are a stand-in interpreter that sleeps until interrupted:
the script's own control flow, timed in whole seconds, with no GPU and no model."""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sleeper(tmp_path: Path) -> Path:
    """A PYTHON for the script: answers its version probe, and otherwise sleeps until its step's SIGINT."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\n[ "$1" = -c ] && [ -n "$NO_RAY" ] && [ "$2" = "import ray" ] && exit 1\n'
                    '[ "$1" = -c ] && { echo "python fake torch none"; exit 0; }\nexec sleep 60\n')
    fake.chmod(0o755)
    return fake


def _measure(tmp_path: Path, **knobs: str) -> tuple[Path, str, float]:
    """Run the script on the stand-in with these knobs: ($OUT, gpu.log's text, the call's seconds)."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(_sleeper(tmp_path)), "DEVICE": "cpu", "SHAPE": "smoke",
           **knobs}
    started = time.monotonic()
    subprocess.run(["bash", str(ROOT / "bench" / "gpu_measure.sh")], env=env, check=True, capture_output=True,
                   timeout=60)
    return out, (out / "gpu.log").read_text(), time.monotonic() - started


def test_a_step_is_cut_to_the_budget_and_one_with_too_little_left_is_skipped(tmp_path):
    out, log, elapsed = _measure(tmp_path, STEPS="d1_cost extraction_cost scale", BUDGET="12", MIN_STEP="3",
                                 T_D1="1", PROFILE="0")
    assert "step d1_cost (limit 1 s)" in log  # under the budget: its own limit
    assert "step extraction_cost: limit 280 s cut to" in log, log
    assert "step scale skipped:" in log, log
    # the call ends near its budget (whole-second clock; a loaded machine's slack): without the cut the stand-in
    # would sleep its 60 s under extraction_cost's 280 s limit
    assert elapsed < 12 + 15, elapsed
    with tarfile.open(out / "results.tar") as bundle:
        assert {"d1_cost.log", "extraction_cost.log"} <= set(bundle.getnames())
    assert sorted(p.name for p in out.iterdir()) == ["gpu.log", "results.tar"]


def test_without_a_budget_to_cut_every_step_keeps_its_own_limit(tmp_path):
    _, log, _ = _measure(tmp_path, STEPS="d1_cost scale", BUDGET="60", T_D1="1", T_SCALE="1")
    assert "step d1_cost (limit 1 s)" in log and "step scale (limit 1 s)" in log, log
    assert "cut to" not in log and "skipped" not in log


def test_without_ray_the_driver_steps_are_skipped_and_said_so(tmp_path):
    """The short lease's kit (bench/gpu_kit.sh bench) carries no Ray: scale.py would fail at its import after the
    call had spent its setup, so the script drops scale, scale_probes and scale_rows up front and names why."""
    _, log, _ = _measure(tmp_path, STEPS="d1_cost scale scale_probes scale_rows", BUDGET="60", T_D1="1",
                         T_SCALE="1", NO_RAY="1")
    assert "steps scale, scale_probes and scale_rows skipped: Ray does not import here" in log, log
    assert "step d1_cost (limit 1 s)" in log and "step scale" not in log, log


def test_scale_rows_runs_the_driver_once_per_row_cap(tmp_path):
    """STEPS=scale_rows: scale.py once per ROWS_SWEEP value with that --batch-size, each into its own JSON."""
    _, log, _ = _measure(tmp_path, STEPS="scale_rows", ROWS_SWEEP="32 64", BUDGET="60", T_SCALE="1", MIN_STEP="1")
    lines = [line for line in log.splitlines() if "step scale_b" in line and "bench/scale.py" in line]
    assert len(lines) == 2, log
    for line, rows in zip(lines, ("32", "64"), strict=True):
        assert f"step scale_b{rows} (limit 1 s)" in line and f"--batch-size {rows} --out" in line, line
        assert line.split("--out ")[1].split()[0].endswith(f"scale_b{rows}.json"), line


def _extraction_lines(tmp_path, setting: tuple[str, str] = ("POOLBENCH_INFLOW_KERNEL", "auto"),
                      **env_extra: str) -> list[str]:
    """The command lines gpu_measure.sh runs extraction_cost with (a fake python records each, after `setting`'s
    variable in its environment, or its default: the inflow kernel's by default)."""
    variable, default = setting
    seen = tmp_path / "seen"
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\n[ "$1" = -c ] && { echo "python fake torch none"; exit 0; }\n'
                    f'echo "${{{variable}:-{default}}} $*" >> {seen}\n')
    fake.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(fake), "DEVICE": "cpu", "SHAPE": "smoke",
           "PROFILE": "0", **env_extra}
    env.pop(variable, None)
    subprocess.run(["bash", str(ROOT / "bench" / "gpu_measure.sh")], env=env, check=True, capture_output=True,
                   timeout=60)
    return seen.read_text().splitlines()


def test_the_chunked_inflow_step_runs_the_stages_with_the_kernel_off(tmp_path):
    """extraction_chunks, the kernel's A/B at stage level: extraction_cost again on CHUNK_STAGES, with
    POOLBENCH_INFLOW_KERNEL=off in its environment only (the step before it keeps the kernel)."""
    first, second = _extraction_lines(tmp_path, STEPS="extraction_cost extraction_chunks",
                                      CHUNK_STAGES="attention,all")
    assert first.startswith("auto bench/extraction_cost.py ") and "--stages forward_backward,hidden" in first
    assert second.startswith("off bench/extraction_cost.py ") and "--stages attention,all" in second
    assert "--out " + str(tmp_path / "out" / "extraction_chunks.json") in second


def test_the_serial_step_runs_the_stages_with_overlap_off(tmp_path):
    """extraction_serial, the overlap's A/B at stage level: extraction_cost again on SERIAL_STAGES with
    --overlap off (the step before it keeps the default: on where CUDA is)."""
    first, second = _extraction_lines(tmp_path, STEPS="extraction_cost extraction_serial")
    assert "--overlap" not in first
    assert second.startswith("auto bench/extraction_cost.py ") and "--stages hidden,all" in second
    assert "--overlap off" in second and "--out " + str(tmp_path / "out" / "extraction_serial.json") in second


def test_the_unstaged_step_runs_the_stages_copying_each_layer_out(tmp_path):
    """extraction_unstaged, the staging's A/B at stage level: extraction_cost again on UNSTAGED_STAGES with
    POOLBENCH_STAGED_COPIES=0 in its environment only (the step before it stages)."""
    first, second = _extraction_lines(tmp_path, ("POOLBENCH_STAGED_COPIES", "default"),
                                      STEPS="extraction_cost extraction_unstaged")
    assert first.startswith("default bench/extraction_cost.py ")
    assert second.startswith("0 bench/extraction_cost.py ") and "--stages hidden,attention,all" in second
    assert "--out " + str(tmp_path / "out" / "extraction_unstaged.json") in second


def test_the_driver_step_runs_the_stages_at_the_drivers_shape(tmp_path):
    """extraction_driver: extraction_cost on DRIVER_STAGES over passages as stored (no packing), the run's default
    layers, one concept a job, beside the step that packs 512-token texts over every layer."""
    first, second = _extraction_lines(tmp_path, STEPS="extraction_cost extraction_driver")
    assert "--pack-to 512" in first and "--layers" not in first
    assert "--pack-to 0 --layers driver --concepts-per-job 1" in second and "--texts 400" in second
    assert "--stages forward_backward,all" in second
    assert "--out " + str(tmp_path / "out" / "extraction_driver.json") in second


def test_the_gpu_tests_run_in_several_processes_where_xdist_imports(tmp_path):
    """The pytest step takes -n TEST_WORKERS where the machine's Python imports xdist (the stand-in answers every
    probe yes), and one process when told 1."""
    _, log, _ = _measure(tmp_path, STEPS="pytest", BUDGET="60", T_TESTS="1", MIN_STEP="1")
    [line] = [line for line in log.splitlines() if "step pytest (limit" in line]
    assert "-n 4 --dist worksteal -m gpu and not slow" in line, line
    (tmp_path / "one").mkdir()
    _, log, _ = _measure(tmp_path / "one", STEPS="pytest", BUDGET="60", T_TESTS="1", MIN_STEP="1", TEST_WORKERS="1")
    [line] = [line for line in log.splitlines() if "step pytest (limit" in line]
    assert "-n " not in line and "-ra -m gpu and not slow" in line, line


def test_a_step_name_it_does_not_know_stops_the_call_before_it_starts(tmp_path):
    """STEPS="pytest extraction_drivr": one line names the typo (in gpu.log and on stderr), exit 2, and no step ran,
    not even the ones it knows: a lease is not spent on a call that would end "done" without the step asked for."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(_sleeper(tmp_path)), "DEVICE": "cpu",
           "SHAPE": "smoke", "STEPS": "pytest extraction_drivr"}
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_measure.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2
    assert "STEPS names no step 'extraction_drivr'; the steps: pytest inflow" in run.stderr
    log = (tmp_path / "out" / "gpu.log").read_text()
    assert "extraction_drivr" in log and "step pytest" not in log
