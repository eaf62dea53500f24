"""bench/scale.py: the driver's own run on a `shape:` model, beside the raw forward, and the projection to PoolBench's
full size; the projection's arithmetic by hand, the JSON's fields and their consistency on a smoke run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from scale import project  # noqa: E402


def test_the_projection_scales_pooling_and_the_forward_per_token_and_d1_per_passage() -> None:
    # 1,000 tokens in 10 passages: raw 2 s, pooling 4 s, D1 5 s; the full size is 17 x 2,000 x 400 = 13.6 M tokens
    # in 34,000 passages: raw 2 x 13,600 = 27,200 s, pooling 4 x 13,600 = 54,400 s, D1 5 x 3,400 = 17,000 s.
    p = project(1000, 10, 2.0, 4.0, 5.0)
    assert (p.tokens, p.passages) == (13_600_000, 34_000)
    assert (p.raw_forward_s, p.pooling_s, p.d1_s, p.total_s) == (27_200.0, 54_400.0, 17_000.0, 71_400.0)
    assert "projection" in p.note and "not a measurement" in p.note
    small = project(1000, 10, 2.0, 4.0, 5.0, concepts=2, per_concept=5, per_passage=100)  # 1,000 tokens, 10 passages
    assert (small.raw_forward_s, small.pooling_s, small.d1_s) == (2.0, 4.0, 5.0)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("scale") / "scale.json"
    done = subprocess.run([sys.executable, str(BENCH / "scale.py"), "--shape", "smoke", "--device", "cpu",
                           "--concepts", "2", "--limit", "5", "--max-length", "32", "--layers", "1",
                           "--strategies", "A1_mean,P1_last", "--n-bootstrap", "20", "--out", str(out)],
                          cwd=BENCH, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_smoke_run_writes_every_stage_beside_the_raw_forward(smoke_run) -> None:
    r = smoke_run
    assert r["benchmark"] == "scale" and r["model"] == "shape:smoke" and r["device"] and r["git"] and r["date"]
    assert r["weights_hash"].startswith("shape-") and r["cuda"] is None and r["dtype"] == "torch.float32"
    assert r["config"]["concepts"] == ["academic_tone", "bureaucratic"] and r["config"]["layers"] == [1]
    assert r["config"]["strategies"] == ["A1_mean", "P1_last"] and r["config"]["reliability"] is True
    # concepts x layers x strategies, read back from the driver's D1 records (a diffmean and a logistic probe each)
    assert r["config"]["cells"] == 2 * 1 * 2 and r["config"]["d1_records"] == 2 * r["config"]["cells"]
    rows = r["per_concept"]
    # --limit 5: five passages per class and split, two classes, two splits
    assert [row["passages"] for row in rows] == [20, 20] and r["passages"] == 40
    # each concept's one layer came back as one D1 task (the driver's LayerProbed event), its records the concept's
    # share of the run's, its seconds split into reading, fitting and writing, back before the concept was probed
    for row in rows:
        [task] = row["d1_layers"]
        assert task["layer"] == 1 and task["cells"] == r["config"]["d1_records"] // 2
        assert task["read_s"] > 0 and task["probe_s"] > 0 and task["write_s"] > 0
        assert row["pooled_at_s"] < task["done_at_s"] <= row["probed_at_s"]
        # from its submission to the driver seeing it: at least the task's own seconds; a CPU run hides the GPUs
        assert task["wall_s"] >= task["read_s"] + task["probe_s"] + task["write_s"]
        assert task["pid"] > 0 and task["pid"] != os.getpid() and task["devices"] == ""
    for key in ("tokens", "padded_tokens"):
        assert r[key] == sum(row[key] for row in rows) > 0
    assert r["padded_tokens"] >= r["tokens"]
    s = r["seconds"]
    assert s["pooling"] == pytest.approx(sum(row["pool_s"] for row in rows), rel=1e-12)
    assert s["raw_forward"] == pytest.approx(sum(row["raw_s"] for row in rows), rel=1e-12)
    assert all(row["pool_s"] > 0 and row["d1_s"] > 0 and row["raw_s"] > 0 for row in rows)
    # on CPU the D1 stage starts after the last pooling: it ends with the last concept probed
    assert r["d1_waits_for_pooling"] and s["d1"] == pytest.approx(max(row["d1_s"] for row in rows), rel=1e-12)
    assert 0 < s["pooling"] + s["d1"] <= s["total"] <= s["bench_wall"]
    # the stages after the last D1 result (the results documents among them): inside the bench's wall clock
    assert 0 < s["after_d1"] < s["bench_wall"] - max(row["probed_at_s"] for row in rows) + 1e-9
    assert r["pooling"]["tokens_per_s"] == pytest.approx(r["tokens"] / s["pooling"], rel=1e-12)
    assert r["raw_forward"]["tokens_per_s"] == pytest.approx(r["tokens"] / s["raw_forward"], rel=1e-12)


def test_the_extractor_counts_its_forwards_on_the_same_tokens_and_the_projection_follows(smoke_run) -> None:
    r = smoke_run
    [extractor] = r["pooling"]["extractors"]
    # the actor pooled exactly the passages and tokens the raw forward timed here
    assert (extractor["passages"], extractor["tokens"]) == (r["passages"], r["tokens"])
    assert extractor["forwards"] == r["pooling"]["forwards"] >= 2  # one job per concept on CPU
    assert r["pooling"]["rows_per_forward"] == r["passages"] / extractor["forwards"]
    assert extractor["peak_kind"] == r["peak_bytes"]["kind"] == "rss"
    # each concept's own job as the actor counted it (one job a concept on CPU): its passages and tokens, and its
    # capture's forwards against the raw forward over the same passages; the jobs sum to the actor's totals
    for row in r["per_concept"]:
        [job] = row["capture"]
        assert job["concepts"] == [row["concept"]] and (job["passages"], job["tokens"]) == (row["passages"],
                                                                                           row["tokens"])
        assert 0 < job["forward_s"] <= job["wall_s"] and job["forward_over_raw"] == job["forward_s"] / row["raw_s"]
        # its forwards one by one, in order: as many as it ran, summing to its forward seconds
        each = job["forward_s_each"]
        assert len(each) == job["forwards"] and sum(each) == pytest.approx(job["forward_s"], rel=1e-12)
        assert (job["first_forward_s"], job["slowest_forward_s"]) == (each[0], max(each))
    assert [job["concepts"] for job in extractor["jobs"]] == [row["capture"][0]["concepts"]
                                                             for row in sorted(r["per_concept"],
                                                                               key=lambda row: row["pooled_at_s"])]
    assert extractor["forward_s"] == pytest.approx(sum(job["forward_s"] for job in extractor["jobs"]), rel=1e-12)
    assert r["peak_bytes"]["extractor"] > 0 and r["peak_bytes"]["raw_forward"] > 0
    p, s = r["projection"], r["seconds"]
    full_tokens, full_passages = 17 * 2000 * 400, 17 * 2000
    assert (p["tokens"], p["passages"]) == (full_tokens, full_passages)
    assert p["pooling_s"] == pytest.approx(s["pooling"] / r["tokens"] * full_tokens, rel=1e-12)
    assert p["raw_forward_s"] == pytest.approx(s["raw_forward"] / r["tokens"] * full_tokens, rel=1e-12)
    assert p["d1_s"] == pytest.approx(s["d1"] / r["passages"] * full_passages, rel=1e-12)
    assert p["total_s"] == pytest.approx(p["pooling_s"] + p["d1_s"], rel=1e-12)
    assert "not a measurement" in p["note"]
    assert all(math.isfinite(v) and v > 0 for v in (p["pooling_s"], p["d1_s"], p["raw_forward_s"]))
    assert set(r["met"]) == set(r["targets"]) and all(isinstance(v, bool) for v in r["met"].values())
    assert "alone" in r["met_d1_from"] and "d1_cost.py times the cells alone" in r["met_d1_from"]
    # a CPU run's probes wait for the pooling: D1 alone is every concept's, the run's D1 seconds, judged on it
    alone = r["d1_alone"]
    assert r["d1_waits_for_pooling"] and alone["seconds"] == s["d1"] and alone["passages"] == r["passages"]
    assert alone["projected_17_concepts_s"] == pytest.approx(p["d1_s"], rel=1e-12) == r["d1_wall_17_s"]
    assert r["met"]["d1_17_concepts_s_max"] == (alone["projected_17_concepts_s"] <= 300.0)
    # The store as it stands on disk: the two strategies' float32 vectors (40 passages x 2 x d 64) and more (ids,
    # Arrow's framing, manifests, sidecars), no S3 head tables; projected per passage to 17 x 2,000.
    store = r["store"]
    assert {"pooled", "d1"} <= set(store["bytes_by_kind"]) and "iti_heads" not in store["bytes_by_kind"]
    assert store["pooled_bytes"] == store["bytes_by_kind"]["pooled"] > 40 * 2 * 64 * 4
    assert store["pooled_bytes_per_passage"] == store["pooled_bytes"] / 40
    assert store["projected_pooled_gb"] == pytest.approx(store["pooled_bytes_per_passage"] * 34_000 / 1e9, rel=1e-12)


def test_after_the_first_concept_is_the_later_concepts_rates_and_a_projection_that_keeps_the_first() -> None:
    from scale import after_the_first
    # pooled in the order b, a, c (pooled_at_s): the first is b, whatever the config's order
    rows = [{"concept": "a", "tokens": 1000, "pool_s": 2.0, "raw_s": 1.0, "pooled_at_s": 20.0},
            {"concept": "b", "tokens": 4000, "pool_s": 30.0, "raw_s": 4.0, "pooled_at_s": 10.0},
            {"concept": "c", "tokens": 3000, "pool_s": 6.0, "raw_s": 2.0, "pooled_at_s": 30.0}]
    warm = after_the_first(rows)
    assert warm["concepts"] == ["a", "c"] and warm["tokens"] == 4000
    assert (warm["pool_s"], warm["raw_s"]) == (8.0, 3.0)
    assert warm["tokens_per_s"] == 500.0 and warm["tokens_per_s_over_raw"] == 3.0 / 8.0
    assert warm["met_pooling_over_raw"] is True  # 0.375 >= 1/3
    # b's 30 s as measured, then 13.6 M - 4,000 tokens at 8 s / 4,000 tokens
    assert warm["projected_pooling_s"] == 30.0 + 8.0 / 4000 * (13_600_000 - 4000)
    assert after_the_first(rows[:1]) is None
    slow = [dict(r, pool_s=r["pool_s"] * 10) for r in rows]
    assert after_the_first(slow)["met_pooling_over_raw"] is False  # 3 / 80 of the raw rate


def test_the_warm_total_adds_the_last_concepts_d1_only_while_d1_keeps_pace_beside_the_forwards() -> None:
    from scale import after_the_first, total_after_the_first
    rows = [{"concept": "a", "tokens": 1000, "passages": 100, "pool_s": 2.0, "raw_s": 1.0, "pooled_at_s": 20.0,
             "probed_at_s": 25.0},
            {"concept": "b", "tokens": 4000, "passages": 400, "pool_s": 30.0, "raw_s": 4.0, "pooled_at_s": 10.0,
             "probed_at_s": 40.0},
            {"concept": "c", "tokens": 3000, "passages": 200, "pool_s": 6.0, "raw_s": 2.0, "pooled_at_s": 30.0,
             "probed_at_s": 36.0}]
    warm = after_the_first(rows)  # 500 tok/s after the first: a full concept (2,000 x 400 tokens) pools in 1,600 s
    pooling = 30.0 + 8.0 / 4000 * (13_600_000 - 4000)
    # D1 per full concept (2,000 passages): a 5 s x 20 = 100, b 30 s x 5 = 150, c 6 s x 10 = 60; c is pooled last
    beside = total_after_the_first(rows, warm, True, 9999.0, 45.0)  # 45 s after the last D1 result, full size
    assert beside["full_concept_pooling_s"] == 1600.0 and beside["d1_per_full_concept_s"] == 150.0
    assert beside["d1_keeps_pace"] is True and beside["d1_after_pooling_s"] == 60.0
    assert beside["pooling_s"] == pooling and beside["total_s"] == pooling + 60.0 + 45.0
    assert "not a measurement" in beside["note"]
    # D1 after the pooling (a CPU run): all of it is added
    waits = total_after_the_first(rows, warm, False, 9999.0, 0.0)
    assert waits["d1_keeps_pace"] is False and waits["total_s"] == pooling + 9999.0
    # b's D1 scaled to a full concept (400 s x 5 = 2,000 s) outlasts a full concept's pooling: all of D1 again
    slow = [dict(r, probed_at_s=410.0) if r["concept"] == "b" else r for r in rows]
    lagging = total_after_the_first(slow, warm, True, 9999.0, 0.0)
    assert lagging["d1_keeps_pace"] is False and lagging["total_s"] == pooling + 9999.0
    assert total_after_the_first(rows[:1], after_the_first(rows[:1]), True, 1.0, 0.0) is None


def test_d1_is_judged_where_it_runs_alone_not_on_a_wall_clock_that_holds_the_later_concepts_pooling() -> None:
    """Beside the pooling, the D1 wall clock from the first concept pooled (10 s here) to the last result (40 s) holds
    the later concepts' pooling; at 17 concepts it would be the pooling's length whatever D1's speed. The judgement
    reads the last concept's D1 (c: pooled last, at 30 s, its last layer at 36 s), which starts when the pooling
    ends; where the probes wait for the pooling, every concept's D1 after it (the run's d1_s)."""
    from scale import d1_alone
    rows = [{"concept": "a", "passages": 100, "pooled_at_s": 20.0, "probed_at_s": 25.0},
            {"concept": "b", "passages": 400, "pooled_at_s": 10.0, "probed_at_s": 40.0},
            {"concept": "c", "passages": 200, "pooled_at_s": 30.0, "probed_at_s": 36.0}]
    beside = d1_alone(rows, True, 30.0)
    assert (beside["seconds"], beside["concepts"], beside["passages"]) == (6.0, ["c"], 200)
    assert beside["projected_17_concepts_s"] == 6.0 * 17 * 2000 / 200 == 1020.0  # the window would say 30 s x 48.6
    waits = d1_alone(rows, False, 12.0)  # every concept's D1 after the last pooling: 12 s for 700 passages
    assert (waits["seconds"], waits["concepts"], waits["passages"]) == (12.0, ["a", "b", "c"], 700)
    assert waits["projected_17_concepts_s"] == pytest.approx(12.0 * 34_000 / 700, rel=1e-15)
    assert "not measured at 17 x 2,000" in beside["note"]


def test_the_smoke_run_reports_the_concepts_after_the_first(smoke_run) -> None:
    r = smoke_run
    warm = r["after_the_first"]
    later = sorted(r["per_concept"], key=lambda row: row["pooled_at_s"])[1:]
    assert warm["concepts"] == [row["concept"] for row in later] and len(later) == 1
    assert warm["pool_s"] == later[0]["pool_s"] and warm["tokens"] == later[0]["tokens"]
    # a CPU run's D1 waits for the pooling: the warm total adds all of the projected D1, and judges the target
    total = r["total_after_the_first"]
    assert total["d1_keeps_pace"] is False and r["met_total_from"] == "total_after_the_first"
    # ... and the stage after D1, measured whole and scaled per passage as D1 is
    after = r["seconds"]["after_d1"] * r["projection"]["passages"] / r["passages"]
    assert total["after_d1_s"] == pytest.approx(after, rel=1e-12) and total["after_d1_s"] > 0
    assert total["total_s"] == pytest.approx(warm["projected_pooling_s"] + r["projection"]["d1_s"] + after, rel=1e-12)
    assert r["met"]["total_s_max"] == (total["total_s"] <= r["targets"]["total_s_max"])


def test_the_seconds_a_pooling_ran_beside_other_concepts_probes_count_each_moment_once() -> None:
    from scale import after_the_first, beside_d1_seconds
    # session 30's H100 run (scale.log): bureaucratic pooled 43.8-71.7 s, academic_tone 71.6-83.5 s, each concept's
    # D1 from its pooling's end to its probed line: academic_tone pooled all of it beside bureaucratic's D1 but 0.1 s
    rows = [{"concept": "bureaucratic", "tokens": 100_715, "pool_s": 27.9, "raw_s": 3.17, "pooled_at_s": 71.7,
             "probed_at_s": 100.3},
            {"concept": "academic_tone", "tokens": 101_509, "pool_s": 11.9, "raw_s": 3.19, "pooled_at_s": 83.5,
             "probed_at_s": 101.3}]
    assert beside_d1_seconds(rows, True) == pytest.approx([0.0, 11.8], abs=1e-9)
    assert beside_d1_seconds(rows, False) == [0.0, 0.0]  # a CPU run's probes wait for the last pooling
    for row, seconds in zip(rows, beside_d1_seconds(rows, True), strict=True):
        row["pooling_beside_d1_s"] = seconds
    assert after_the_first(rows)["pool_s_beside_d1"] == pytest.approx(11.8, abs=1e-9)
    # two other concepts' probes overlapping each other inside one pooling: 2-6 and 4-8 s cover 6 s, not 8
    three = [{"pool_s": 10.0, "pooled_at_s": 10.0, "probed_at_s": 30.0},
             {"pool_s": 1.0, "pooled_at_s": 2.0, "probed_at_s": 6.0},
             {"pool_s": 1.0, "pooled_at_s": 4.0, "probed_at_s": 8.0}]
    assert beside_d1_seconds(three, True)[0] == 6.0


def test_a_group_jobs_capture_is_each_of_its_concepts_and_a_concept_pooled_in_passes_keeps_each_pass() -> None:
    """capture_by_concept: a job of two concepts is both one's, against their raw forwards summed (its seconds are
    the group's, not split); a concept whose layers were pooled in two passes keeps both jobs, each against its own
    raw forward (each pass runs the whole forward); a lost extractor's entry holds no jobs."""
    from scale_counters import capture_by_concept

    group = {"concepts": ["a", "b"], "forward_s": 6.0}
    passes = [{"concepts": ["c"], "forward_s": 2.0}, {"concepts": ["c"], "forward_s": 3.0}]
    by_concept = capture_by_concept([{"jobs": [group, *passes[:1]]}, {"jobs": passes[1:]}, {"error": "lost"}],
                                    {"a": 1.0, "b": 2.0, "c": 1.0})
    assert by_concept["a"] == by_concept["b"] == [{**group, "forward_over_raw": 2.0}]
    assert [job["forward_over_raw"] for job in by_concept["c"]] == [2.0, 3.0]
    assert capture_by_concept([{"jobs": [{"concepts": ["d"], "forward_s": 1.0}]}], {})["d"][0]["forward_over_raw"] \
        is None  # no raw forward timed for it: no ratio, not a division by zero


def test_a_jobs_forwards_one_by_one_show_a_start_in_the_first_and_a_steady_cost_in_the_median() -> None:
    """forward_spread: a job whose first forward holds a one-time start (bench/measured/h200_session36: ~16 s on a
    machine's first run) reads as a first forward far above its median; no forwards, no figures (not zeros)."""
    from scale_counters import forward_spread

    spread = forward_spread([16.4, 0.4, 0.5, 0.38, 0.41])
    assert (spread["first_forward_s"], spread["median_forward_s"], spread["slowest_forward_s"]) == (16.4, 0.41, 16.4)
    assert spread["forward_s_each"] == [16.4, 0.4, 0.5, 0.38, 0.41]
    assert forward_spread([]) == {"forward_s_each": [], "first_forward_s": None, "median_forward_s": None,
                                  "slowest_forward_s": None}


def test_a_smoke_run_that_drops_its_vectors_counts_the_most_the_store_held_and_projects_none(tmp_path) -> None:
    """--drop-pooled: the store ends without pooled artifacts, so scale.json gives the most it held as each concept
    was pooled or probed (one concept's at least: its shards are there when its pooling is reported) and no
    per-passage projection of a count that is gone."""
    out = tmp_path / "scale.json"
    done = subprocess.run([sys.executable, str(BENCH / "scale.py"), "--shape", "smoke", "--device", "cpu",
                           "--concepts", "2", "--limit", "5", "--max-length", "32", "--layers", "1",
                           "--strategies", "A1_mean,P1_last", "--n-bootstrap", "20", "--drop-pooled",
                           "--out", str(out)],
                          cwd=BENCH, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    store = r["store"]
    assert store["drop_pooled"] is True and r["config"]["drop_pooled"] is True
    assert "pooled" not in store["bytes_by_kind"] and "projected_pooled_gb" not in store
    one_concept = 20 * 2 * 64 * 4  # 20 passages, 2 strategies of the smoke shape's width 64, float32: its payload
    # at least the concept just pooled; at most both (on a CPU both are pooled before either is probed, the disk's
    # room allowing), each with its ids, Arrow framing and sidecar (a few kB here; 64 KiB allowed)
    assert one_concept < store["peak_pooled_bytes"] < 2 * (one_concept + 65_536)
    assert "pooled artifacts at most" in done.stdout
