"""`make cluster-up` / `cluster-down`: a local Ray head, the Serve app and (for an s3:// store) an S3 server.

Every process cluster-up starts is its own process group with a pid file under .poolbench-cluster/, and
cluster-down stops exactly those (never `ray stop`, which would stop every Ray on a shared machine). If a step
fails, the steps already done are undone before the one-line error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from poolbench.errors import PoolBenchError

STATE_DIR = Path(".poolbench-cluster")


class ClusterError(PoolBenchError):
    """cluster-up could not start a piece (what was started is already stopped again)."""


def port_in_use(port: int, host: str = "") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _spawn(name: str, cmd: list[str], state: Path, env: dict | None = None) -> subprocess.Popen:
    log = open(state / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it for its lifetime
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    (state / f"{name}.pid").write_text(str(proc.pid))
    return proc


def _wait(what: str, ready, proc: subprocess.Popen, state: Path, name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (state / f"{name}.log").read_text(errors="replace").strip().splitlines()[-1:] or ["?"]
            raise ClusterError(f"{what} exited with code {proc.returncode}: {tail[0][:200]}")
        if ready():
            return
        time.sleep(0.2)
    raise ClusterError(f"{what} did not come up within {timeout_s:.0f}s (log: {state / name}.log)")


def _http_answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def stop_pid(pid: int, timeout_s: float = 15.0) -> None:
    """SIGTERM the process group cluster-up created, then SIGKILL it if it lingers."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def start_s3(store: str, port: int, state: Path) -> str:
    """MinIO when a `minio` binary is on PATH, else moto_server; then the store's bucket. Returns the endpoint."""
    bucket = store[len("s3://"):].split("/")[0]
    access = os.environ.get("AWS_ACCESS_KEY_ID", "poolbench")
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "poolbench-secret")
    endpoint = f"http://127.0.0.1:{port}"
    minio_bin = shutil.which("minio")
    if minio_bin:
        cmd = [minio_bin, "server", str(state / "minio-data"), "--address", f"127.0.0.1:{port}"]
        env = {"MINIO_ROOT_USER": access, "MINIO_ROOT_PASSWORD": secret}
    else:
        moto = Path(sys.executable).with_name("moto_server")
        cmd = [str(moto) if moto.exists() else sys.executable, *([] if moto.exists() else ["-m", "moto.server"]),
               "-H", "127.0.0.1", "-p", str(port)]
        env = {}
    proc = _spawn("s3", cmd, state, env)
    _wait(f"S3 server ({Path(cmd[0]).name}) on port {port}", lambda: _http_answers(endpoint), proc, state, "s3", 30)
    from minio import Minio
    from minio.error import MinioException

    client = Minio(f"127.0.0.1:{port}", access_key=access, secret_key=secret, secure=False,
                   region=os.environ.get("AWS_REGION", "us-east-1"))
    try:
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)
    except (ValueError, OSError, MinioException) as exc:
        raise ClusterError(f"cannot create bucket {bucket!r} on {endpoint}: {str(exc).splitlines()[0][:200]}") from exc
    return endpoint


def start_ray(port: int, state: Path, num_cpus: int | None) -> str:
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [str(ray_bin), "start", "--head", f"--port={port}", "--disable-usage-stats", "--block",
           "--include-dashboard=false", *([f"--num-cpus={num_cpus}"] if num_cpus else [])]
    proc = _spawn("ray", cmd, state)
    address = f"127.0.0.1:{port}"
    log = state / "ray.log"
    _wait(f"Ray head on port {port}", lambda: "Ray runtime started" in log.read_text(errors="replace")
          and port_in_use(port), proc, state, "ray", 90)
    return address


def start_serve_app(address: str, models: list[str], host: str, port: int, state: Path,
                    run: Path | None = None) -> str:
    """Deploy the one HTTP app (poolbench.http.app) from a short-lived driver: Serve's controller is detached, it
    lives with the cluster. With `run`, /score serves the scorers that run recorded."""
    from poolbench.http.app import ServiceSettings, scorers_of_run

    settings = ServiceSettings(models=tuple(models), **(scorers_of_run(run) if run is not None else {}))
    code = ("import json,sys,ray; from poolbench.http.app import ServiceSettings, start_serve; "
            "a=json.loads(sys.argv[1]); ray.init(address=a['address'], logging_level='ERROR'); "
            "print(start_serve(ServiceSettings(**a['settings']), host=a['host'], port=a['port']))")
    # "auto": the head `ray start` just wrote to /tmp/ray/ray_current_cluster. An explicit host:port fails here
    # with Ray 2.60 (InvalidAuthToken while a ~/.ray/auth_token exists), `auto` connects.
    args = json.dumps({"address": "auto", "settings": settings.model_dump(mode="json"), "host": host, "port": port})
    done = subprocess.run([sys.executable, "-c", code, args], capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise ClusterError(f"Serve app did not start on {host}:{port}: {last[:200]}")
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + 60
    while not _http_answers(f"{url}/healthz"):
        if time.monotonic() > deadline:
            raise ClusterError(f"Serve app on {url} did not answer /healthz within 60s")
        time.sleep(0.3)
    return url


def cluster_up(*, ray_port: int = 6379, serve_port: int = 8000, s3_port: int = 9000, host: str = "127.0.0.1",
               store: str | None = None, models: list[str] | None = None, num_cpus: int | None = None,
               state: Path = STATE_DIR, serve: bool = True, run: Path | None = None) -> dict:
    """Start what is missing, in order; on any failure stop what this call started and raise one line."""
    store = store if store is not None else os.environ.get("POOLBENCH_STORE", "")
    if run is not None:
        from poolbench.http.app import scorers_of_run

        scorers_of_run(run)  # a bad run folder fails here, before anything starts
    if (state / "cluster.json").exists():
        raise ClusterError(f"a cluster is already up ({state / 'cluster.json'}): run `make cluster-down` first")
    wanted = [("Ray head", ray_port)] + ([("Serve HTTP", serve_port)] if serve else [])
    wanted += [("S3 server", s3_port)] if store.startswith("s3://") else []
    for what, port in wanted:
        if port_in_use(port):
            raise ClusterError(f"port {port} is already in use ({what}): pick another or stop what holds it")
    state.mkdir(parents=True, exist_ok=True)
    info: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        if store.startswith("s3://"):
            info["s3_endpoint"] = start_s3(store, s3_port, state)
            info["store"] = store
        info["ray_address"] = start_ray(ray_port, state, num_cpus)
        if serve:
            info["serve_url"] = start_serve_app(info["ray_address"], models or ["embedded"], host, serve_port, state,
                                                run)
    except BaseException:
        cluster_down(state)
        raise
    (state / "cluster.json").write_text(json.dumps(info, indent=1))
    return info


def cluster_down(state: Path = STATE_DIR) -> list[str]:
    """Stop every process a pid file names (Ray first, then S3), remove the pid files; returns what was stopped."""
    stopped = []
    for name in ("ray", "s3"):
        pid_file = state / f"{name}.pid"
        if pid_file.exists():
            stop_pid(int(pid_file.read_text()))
            pid_file.unlink()
            stopped.append(name)
    with contextlib.suppress(FileNotFoundError):
        (state / "cluster.json").unlink()
    return stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m poolbench.cluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up")
    up.add_argument("--ray-port", type=int, default=6379)
    up.add_argument("--serve-port", type=int, default=8000)
    up.add_argument("--s3-port", type=int, default=9000)
    up.add_argument("--host", default="127.0.0.1", help="where Serve listens (loopback unless you say so)")
    up.add_argument("--store", default=None, help="s3://bucket/prefix: also start an S3 server")
    up.add_argument("--models", default="embedded", help="comma-separated model ids/paths the HTTP app may load")
    up.add_argument("--num-cpus", type=int, default=None)
    up.add_argument("--run", type=Path, default=None, help="a run folder: /score serves the scorers it recorded")
    up.add_argument("--no-serve", action="store_true")
    up.add_argument("--state", type=Path, default=STATE_DIR)
    down = sub.add_parser("down")
    down.add_argument("--state", type=Path, default=STATE_DIR)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            info = cluster_up(ray_port=args.ray_port, serve_port=args.serve_port, s3_port=args.s3_port,
                              host=args.host, store=args.store, models=args.models.split(","),
                              num_cpus=args.num_cpus, state=args.state, serve=not args.no_serve, run=args.run)
            print(" · ".join(f"{k} {v}" for k, v in info.items() if k != "started"))
            print("next: poolbench-driver run --address auto")
        else:
            stopped = cluster_down(args.state)
            print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
    except PoolBenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0

