"""Concurrent load on the HTTP app: mixed /pool, /probe and /generate (steered and not) from many clients at once.

Every distinct request is first served alone, one after another; under load, every answer must equal that one
bit for bit (timing fields aside), so shared hooks or state between requests show up as mismatches, not as
noise. Loopback only; bounded in request count and in time. `--clients 16,32,64,128` runs one level after another
against the same app. A 503/429 with Retry-After is backpressure, not an error: the client waits that long and sends
the request again (counted as `rejected`). Latency is the answered attempt's (served p50/p99) and, separately, from
the first attempt to the answer (end-to-end p99). Prints a table and writes bench/results/serve_load.json: per level
requests/s, latencies, rejected, non-2xx errors and wrong answers (both must be 0), and, for an app started here,
the CPU seconds of the clients, Serve's proxy and the replica (they share this machine's cores).
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import os
import random
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import psutil

TIMING_FIELDS = ("seconds",)  # the only part of an answer that may differ between two servings
WORDS = ("the cat sat on the mat", "perhaps it will rain", "water boils at noon", "she might be right",
         "a red door opened slowly", "maybe we should wait", "the train leaves at four", "possibly not today")


class LoadError(Exception):
    """The load test cannot run as asked (a non-loopback URL, an app that does not answer)."""


def check_loopback(url: str) -> None:
    """Refuse anything but a loopback address: this bench floods the app it is pointed at."""
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise LoadError(f"{url}: serve_load only targets loopback (127.0.0.1, ::1, localhost)")


PROMPTS = ("the cat", "a dog", "my friend said", "the weather today", "in the morning", "she opened the",
           "we could try", "the report shows")


def request_mix(model: str, layers: Sequence[int], hidden_size: int, seed: int = 0,
                variants: int = 1) -> list[tuple[str, dict]]:
    """Distinct requests covering each endpoint, `variants` times over with other texts, prompts and seeds:
    pooling at every layer with three strategies (and attention-weighted S1, which swaps the model's attention
    function while it runs), two probes, and generation unsteered, strongly steered (the case that corrupted
    concurrent /pool replies) and sampled. Identical rows are computed once in a batch, so a mix of few distinct
    requests would measure that instead of the service."""
    rng = random.Random(seed)
    mix: list[tuple[str, dict]] = []
    for variant in range(variants):
        for layer in layers:
            for strategy in ("A1_mean", "P1_last", "A2_max"):
                mix.append(("/pool", {"model": model, "layer": layer, "strategy": strategy,
                                      "texts": rng.sample(WORDS, rng.randint(2, 4))}))
        mix.append(("/pool", {"model": model, "layer": layers[0], "strategy": "S1_attention",
                              "texts": rng.sample(WORDS, 3)}))
        for layer, strategy in zip(layers, itertools.cycle(("A1_mean", "P1_last")), strict=False):
            texts = rng.sample(WORDS, len(WORDS)) + rng.sample(WORDS, 4)
            items = [{"text": text, "label": int(i % 2 == 0), "split": "train" if i < 8 else "test",
                      "group": f"g{i // 2}"} for i, text in enumerate(texts)]
            mix.append(("/probe", {"model": model, "layer": layer, "strategy": strategy, "items": items,
                                   "n_folds": 2, "n_bootstrap": 100, "seed": variant}))
        direction = [1.0] * hidden_size
        prompts = ["the cat", "a dog"] if variant == 0 else rng.sample(PROMPTS, 2)
        base = {"model": model, "prompts": prompts, "layer": layers[-1], "max_new_tokens": 4}
        mix += [("/generate", {**base, "greedy": True}),
                ("/generate", {**base, "greedy": True, "vector": direction, "alpha": 50.0 - variant}),
                ("/generate", {**base, "vector": direction, "alpha": -8.0, "seed": 3 + variant})]
    return mix


def comparable(answer: dict) -> dict:
    return {k: v for k, v in answer.items() if k not in TIMING_FIELDS}


class Busy(Exception):
    """A 503/429 with Retry-After: the app is shedding load; retry after `seconds`."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"busy, retry after {seconds:g} s")
        self.seconds = seconds


@dataclass
class Outcome:
    index: int  # into the mix
    path: str
    seconds: float  # the answered attempt
    error: str | None = None
    mismatch: bool = False
    rejected: int = 0  # 503/429 answers with Retry-After before this one
    end_to_end_s: float = 0.0  # first attempt to answer, backoffs included


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self, clients: int, planned: int) -> dict:
        endpoints = {}
        for path in sorted({o.path for o in self.outcomes}):
            mine = [o for o in self.outcomes if o.path == path]
            endpoints[path] = {"requests": len(mine), "errors": sum(o.error is not None for o in mine),
                               "mismatches": sum(o.mismatch for o in mine),
                               "rejected": sum(o.rejected for o in mine),
                               "requests_per_s": len(mine) / self.wall_s, **_latencies(mine)}
        errors = [o.error for o in self.outcomes if o.error is not None]
        answered = [o for o in self.outcomes if o.error is None]
        return {"clients": clients, "planned": planned, "completed": len(self.outcomes), "wall_s": self.wall_s,
                "requests_per_s": len(answered) / self.wall_s, "errors": len(errors),
                "mismatches": sum(o.mismatch for o in self.outcomes),
                "rejected": sum(o.rejected for o in self.outcomes), "first_errors": errors[:5],
                **_latencies(answered), "endpoints": endpoints}


ROLES = (("ServeReplica", "replica"), ("ProxyActor", "proxy"), ("ServeController", "controller"),
         ("raylet", "raylet"), ("gcs_server", "gcs"))


def cpu_by_role() -> dict[str, float]:
    """CPU seconds so far of this process (the clients) and of every process under it (the Ray it started), by
    role: where the 2 cores go at each level, since the clients, Serve's proxy and the replica share them."""
    me = psutil.Process()
    seconds: dict[str, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            command = " ".join(proc.cmdline()[:2])
        except psutil.Error:
            continue
        role = "clients" if proc.pid == me.pid else next((r for key, r in ROLES if key in command), "other")
        seconds[role] = seconds.get(role, 0.0) + times.user + times.system
    return seconds


def _latencies(outcomes: Sequence[Outcome]) -> dict:
    if not outcomes:
        return {"p50_ms": None, "p99_ms": None, "e2e_p99_ms": None}
    served = np.array([1000 * o.seconds for o in outcomes])
    e2e = np.array([1000 * o.end_to_end_s for o in outcomes])
    return {"p50_ms": float(np.percentile(served, 50)), "p99_ms": float(np.percentile(served, 99)),
            "e2e_p99_ms": float(np.percentile(e2e, 99))}


def post(client: httpx.Client, base: str, path: str, body: dict, token: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    reply = client.post(f"{base}{path}", json=body, headers=headers)
    if reply.status_code in (429, 503) and "retry-after" in reply.headers:
        raise Busy(float(reply.headers["retry-after"]))
    if reply.status_code != 200:
        raise LoadError(f"{path}: HTTP {reply.status_code}: {reply.text[:200]}")
    return reply.json()


def serve_alone(base: str, mix: Sequence[tuple[str, dict]], timeout_s: float, token: str | None = None) -> list[dict]:
    """The reference: each request on its own, nothing else in flight."""
    with httpx.Client(timeout=timeout_s) as client:
        return [comparable(post(client, base, path, body, token)) for path, body in mix]


def fire(base: str, mix: Sequence[tuple[str, dict]], reference: Sequence[dict], *, clients: int, requests: int,
         time_limit_s: float, timeout_s: float, seed: int = 0, token: str | None = None) -> LoadResult:
    """`requests` requests (mix entries in a shuffled cycle) from `clients` threads; none starts after the limit."""
    order = [i % len(mix) for i in range(requests)]
    random.Random(seed).shuffle(order)
    queue = iter(order)
    lock = threading.Lock()
    result = LoadResult()
    deadline = time.monotonic() + time_limit_s

    def client_loop() -> None:
        with httpx.Client(timeout=timeout_s) as client:
            while time.monotonic() < deadline:
                with lock:
                    index = next(queue, None)
                if index is None:
                    return
                path, body = mix[index]
                first = time.perf_counter()
                outcome = Outcome(index, path, 0.0)
                while True:
                    start = time.perf_counter()
                    try:
                        outcome.mismatch = comparable(post(client, base, path, body, token)) != reference[index]
                    except Busy as busy:
                        outcome.rejected += 1
                        if time.monotonic() + busy.seconds < deadline + timeout_s:
                            time.sleep(busy.seconds)  # the app asked for this pause: backpressure, not a race
                            continue
                        outcome.error = f"Busy: still refused at the time limit ({outcome.rejected} tries)"
                    except (httpx.HTTPError, LoadError) as exc:
                        outcome.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    break
                outcome.seconds = time.perf_counter() - start
                outcome.end_to_end_s = time.perf_counter() - first
                with lock:
                    result.outcomes.append(outcome)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        for future in [pool.submit(client_loop) for _ in range(clients)]:
            future.result()
    result.wall_s = time.perf_counter() - started
    return result


def run_load(base: str, model: str, layers: Sequence[int], *, clients: int | Sequence[int] = 16,
             requests: int = 200, time_limit_s: float = 120.0, timeout_s: float = 60.0, seed: int = 0,
             token: str | None = None, variants: int = 1) -> dict:
    """Reference answers alone, then the concurrent load at each client count; the summary dict the JSON holds
    (one level's figures at the top when `clients` is a number, a `levels` list otherwise)."""
    check_loopback(base)
    with httpx.Client(timeout=timeout_s) as client:
        probe = post(client, base, "/pool", {"model": model, "layer": layers[0], "texts": ["x"]}, token)
    mix = request_mix(model, layers, probe["dim"], seed, variants)
    reference = serve_alone(base, mix, timeout_s, token)
    head = {"url": base, "model": model, "layers": list(layers), "distinct_requests": len(mix)}
    levels = [clients] if isinstance(clients, int) else list(clients)
    summaries = []
    for n in levels:
        before = cpu_by_role()
        level = fire(base, mix, reference, clients=n, requests=requests, time_limit_s=time_limit_s,
                     timeout_s=timeout_s, seed=seed, token=token).summary(n, requests)
        after = cpu_by_role()
        level["cpu_s"] = {role: after[role] - before.get(role, 0.0) for role in sorted(after)}
        summaries.append(level)
    if isinstance(clients, int):
        return {**head, **summaries[0]}
    return {**head, "levels": summaries}


def print_table(summary: dict) -> None:
    """One row per client level: throughput, served and end-to-end latency, backpressure, errors, wrong answers."""
    from rich.console import Console
    from rich.table import Table

    levels = summary.get("levels") or [summary]
    table = Table("clients", "answered", "req/s", "p50 ms", "p99 ms", "e2e p99 ms", "503 (retried)", "non-2xx",
                  "wrong", title=f"serve_load: {summary['distinct_requests']} distinct requests, mixed "
                                 "/pool /probe /generate, answers compared with each served alone")
    for level in levels:
        def ms(key: str, row: dict = level) -> str:
            return "-" if row.get(key) is None else f"{row[key]:.0f}"
        table.add_row(str(level["clients"]), f"{level['completed'] - level['errors']}/{level['planned']}",
                      f"{level['requests_per_s']:.1f}", ms("p50_ms"), ms("p99_ms"), ms("e2e_p99_ms"),
                      str(level["rejected"]), str(level["errors"]), str(level["mismatches"]))
    Console(width=max(Console().width, 110)).print(table)
    for level in levels:
        if level.get("cpu_s"):
            shares = ", ".join(f"{role} {s:.1f}" for role, s in sorted(level["cpu_s"].items(), key=lambda kv: -kv[1]))
            Console().print(f"CPU s at {level['clients']} clients over {level['wall_s']:.1f} s wall: {shares}",
                            highlight=False)
    for level in levels:
        for error in level["first_errors"]:
            Console().print(f"error at {level['clients']} clients: {error}", highlight=False)


def _wait_healthy(base: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise LoadError(f"{base}/healthz did not answer within {timeout_s:.0f} s")


def main() -> int:
    from bench_io import RESULTS, run_header, write_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running app on loopback (default: start one here)")
    parser.add_argument("--model", default="embedded", help="model id/path the app serves")
    parser.add_argument("--layers", default="0,1", help="comma list of layers the mix uses")
    parser.add_argument("--variants", type=int, default=32, help="the mix of 12 distinct requests, this many times "
                        "over with other texts, prompts and seeds")
    parser.add_argument("--clients", default="16", help="client counts, one level each: 16,32,64,128")
    parser.add_argument("--requests", type=int, default=400, help="requests at each level (an upper bound)")
    parser.add_argument("--time-limit", type=float, default=120.0, help="no request starts after this many s")
    parser.add_argument("--timeout", type=float, default=60.0, help="per-request timeout, s")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the private Ray when starting the app")
    parser.add_argument("--max-working", type=int, default=None, help="max_working of the app started here")
    parser.add_argument("--max-queued", type=int, default=None, help="max_queued of the app started here")
    parser.add_argument("--token", default=os.environ.get("POOLBENCH_TOKEN"), help="bearer token of the app")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_load.json")
    args = parser.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    clients = [int(x) for x in args.clients.split(",")]
    started_here = args.url is None
    try:
        if started_here:
            import socket

            import ray

            from poolbench.driver.local_ray import LOOPBACK_RUNTIME_ENV, init_local_ray
            from poolbench.http.app import start_serve
            from poolbench.http.settings import ServiceSettings

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            init_local_ray(num_cpus=args.num_cpus, runtime_env=LOOPBACK_RUNTIME_ENV)
            sizes = {k: v for k, v in (("max_working", args.max_working), ("max_queued", args.max_queued))
                     if v is not None}
            base = start_serve(ServiceSettings(models=(args.model,), **sizes), host="127.0.0.1", port=port)
        else:
            base = args.url.rstrip("/")
            check_loopback(base)
        _wait_healthy(base, 120)
        summary = run_load(base, args.model, layers, clients=clients if len(clients) > 1 else clients[0],
                           requests=args.requests, time_limit_s=args.time_limit, timeout_s=args.timeout,
                           token=args.token, variants=args.variants)
    except LoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if started_here:
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    print_table(summary)
    write_result({**run_header("serve_load", args, base), **summary}, args.out)
    levels = summary.get("levels") or [summary]
    return 0 if all(level["errors"] == 0 and level["mismatches"] == 0 for level in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
