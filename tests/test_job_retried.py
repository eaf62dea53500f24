"""A lost worker or node reaches a person as one progress line, and results.json as a record of what ran again."""

from __future__ import annotations

import io
from collections import Counter

from poolbench.cli.progress import LineProgress
from poolbench.cli.run_display import RunDisplay
from poolbench.records.cluster import ClusterActivity
from poolbench.records.events import JobRetried

LOST = JobRetried("pool code_docs", 2, "pool code_docs failed: its worker died (The actor is unavailable)",
                  "127.0.0.1:41234", "lost", "127.0.0.1:41301")


def test_each_way_of_losing_a_worker_is_one_line_naming_the_node_the_job_and_where_it_goes():
    assert LOST.line == "node 127.0.0.1:41234 lost; retrying pool code_docs on 127.0.0.1:41301 (attempt 2)"
    unreachable = JobRetried("probe toxicity layer 1", 3, "x", "127.0.0.1:41234", "unreachable", "")
    assert unreachable.line == "node 127.0.0.1:41234 unreachable; retrying probe toxicity layer 1 on a new worker " \
                               "(attempt 3)"
    died = JobRetried("steer frustration/A1_mean/layer 1", 2, "x", "", "died", "127.0.0.1:41301")
    assert died.line == "worker on an unknown node died; retrying steer frustration/A1_mean/layer 1 on " \
                        "127.0.0.1:41301 (attempt 2)"


def test_the_run_display_prints_the_line_alone_in_a_log():
    stream = io.StringIO()
    RunDisplay(LineProgress(stream)).show(LOST)
    assert stream.getvalue() == LOST.line + "\n"


def test_cluster_activity_gathers_both_stages():
    pooled = ClusterActivity().merged("pool", Counter({"127.0.0.1:2": 3, "127.0.0.1:1": 1}), ["127.0.0.1:41234"],
                                      [LOST])
    both = pooled.joined(ClusterActivity().merged("steer", Counter({"127.0.0.1:1": 2}), ["127.0.0.1:41234"], []))
    assert both.to_dict() == {
        "jobs_by_node": {"pool": {"127.0.0.1:1": 1, "127.0.0.1:2": 3}, "steer": {"127.0.0.1:1": 2}},
        "lost_nodes": ["127.0.0.1:41234"],
        "retried": [{"job": "pool code_docs", "attempt": 2, "cause": LOST.cause, "node": "127.0.0.1:41234",
                     "how": "lost", "on": "127.0.0.1:41301"}]}
