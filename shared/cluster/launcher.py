"""`make cluster-up` / `cluster-down`: our own Ray head, the Serve app and (for an s3:// store) an S3 server.

Contained: cluster-up starts its own Ray head (own temp dir, own auth token, a cluster id as node label, every
port loopback unless told otherwise) and deploys only into it through the explicit address; every later command
checks the cluster id. Each process it starts is recorded under .poolbench-cluster/ with its kernel start time, and
cluster-down stops exactly those (never `ray stop`, which stops every Ray on the machine), gracefully first. If a
step fails, the steps already done are undone before the one-line error.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from poolbench.cluster.processes import is_ours, members, proc_stat, stop_tree
from poolbench.cluster.session import CLUSTER_LABEL, ray_env
from poolbench.errors import PoolBenchError

STATE_DIR = Path(".poolbench-cluster")
LOOPBACK = "127.0.0.1"


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


def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on now: Ray's side ports get one each, so no fixed default collides on a shared box."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _spawn(name: str, cmd: list[str], state: Path, env: dict | None = None) -> subprocess.Popen:
    log = open(state / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it for its lifetime
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    stat = proc_stat(proc.pid)
    record = {"pid": proc.pid, "start_ticks": stat.start_ticks if stat else -1}
    (state / f"{name}.pid").write_text(json.dumps(record))
    return proc


def read_pid(state: Path, name: str) -> dict | None:
    """The record of a process cluster-up started ({"pid", "start_ticks"}), or None."""
    path = state / f"{name}.pid"
    if not path.exists():
        return None
    text = path.read_text().strip()
    return json.loads(text) if text.startswith("{") else {"pid": int(text), "start_ticks": -1}


def cluster_pids(state: Path = STATE_DIR) -> dict[int, str]:
    """Every live process of the recorded groups (and their descendants), with the group's name."""
    found: dict[int, str] = {}
    for name in ("ray", "s3"):
        record = read_pid(state, name)
        if record and is_ours(record["pid"], record["start_ticks"]):
            found.update(dict.fromkeys(members(record["pid"]), name))
    return found


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


def start_ray(port: int, state: Path, num_cpus: int | None, *, cluster_id: str, node_ip: str = LOOPBACK) -> dict:
    """`ray start --head --block` with our own temp dir, token, cluster-id label and a free port for every side server.

    The temp dir is short (Ray's socket paths must fit 107 bytes) and private, so no other Ray's `auto` finds us and
    we never touch /tmp/ray. Returns what cluster.json records about the head.
    """
    token = state / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    temp_dir = tempfile.mkdtemp(prefix="pb-ray-")
    ray_bin = Path(sys.executable).with_name("ray")
    side = {flag: free_port() for flag in ("ray-client-server-port", "dashboard-agent-listen-port",
                                           "dashboard-agent-grpc-port", "runtime-env-agent-port",
                                           "metrics-export-port", "node-manager-port", "object-manager-port")}
    cmd = [str(ray_bin), "start", "--head", f"--port={port}", f"--node-ip-address={node_ip}",
           f"--temp-dir={temp_dir}", f"--labels={CLUSTER_LABEL}={cluster_id}", "--disable-usage-stats",
           "--include-dashboard=false", "--min-worker-port=0", "--max-worker-port=0", "--block",
           *(f"--{flag}={value}" for flag, value in side.items()), *([f"--num-cpus={num_cpus}"] if num_cpus else [])]
    head = {"ray_address": f"{node_ip}:{port}", "ray_temp_dir": temp_dir, "ray_token": str(token.resolve()),
            "node_ip": node_ip}
    _save(state, head)
    env = ray_env(token, node_ip)
    (state / "ray.env").write_text("".join(f"{key}={value}\n" for key, value in env.items()))
    proc = _spawn("ray", cmd, state, env)
    log = state / "ray.log"
    _wait(f"Ray head on port {port}", lambda: "Ray runtime started" in log.read_text(errors="replace")
          and port_in_use(port), proc, state, "ray", 120)
    return head


def _session(action: str, info: dict, timeout_s: float, **extra) -> subprocess.CompletedProcess:
    """Run poolbench.cluster.session in a fresh process with our head's environment (never the caller's Ray)."""
    args = json.dumps({"address": info["ray_address"], "cluster_id": info["cluster_id"], **extra})
    env = {**os.environ, **ray_env(Path(info["ray_token"]), info["node_ip"])}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "poolbench.cluster.session", action, args], capture_output=True,
                          text=True, timeout=timeout_s, env=env)


def start_serve_app(info: dict, models: list[str], host: str, port: int, run: Path | None = None,
                    steering_backend: str = "transformers") -> str:
    """Deploy the one HTTP app (poolbench.http.app) into OUR head from a short-lived driver; Serve's controller is
    detached and lives with the cluster. With `run`, /score serves the scorers that run recorded and /generate
    its stored steering vectors, and /leaderboard its leaderboard (a cross-model run's table)."""
    from poolbench.http.leaderboard_route import run_serving
    from poolbench.http.settings import ServiceSettings

    from_run = {} if run is None else run_serving(run)
    settings = ServiceSettings(models=tuple(models), steering_backend=steering_backend, **from_run)
    done = _session("deploy", info, 240, settings=settings.model_dump(mode="json"), host=host, port=port)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1].removeprefix("error: ")
        raise ClusterError(f"Serve app did not start on {host}:{port}: {last[:200]}")
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + 60
    while not _http_answers(f"{url}/healthz"):
        if time.monotonic() > deadline:
            raise ClusterError(f"Serve app on {url} did not answer /healthz within 60s")
        time.sleep(0.3)
    return url


def _load(state: Path) -> dict:
    path = state / "cluster.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _save(state: Path, update: dict) -> None:
    """cluster.json grows step by step, so a rollback (or a later cluster-down) knows everything started so far."""
    path = state / "cluster.json"
    path.write_text(json.dumps({**_load(state), **update}, indent=1))


def cluster_up(*, ray_port: int = 6379, serve_port: int = 8000, s3_port: int = 9000, host: str = LOOPBACK,
               ray_host: str = LOOPBACK, store: str | None = None, models: list[str] | None = None,
               num_cpus: int | None = None, state: Path = STATE_DIR, serve: bool = True,
               run: Path | None = None, steering_backend: str = "transformers") -> dict:
    """Start our head, the Serve app and the S3 server, in order; on any failure stop what this call started."""
    store = store if store is not None else os.environ.get("POOLBENCH_STORE", "")
    if serve and steering_backend == "vllm":
        from poolbench.steerer.vllm_backend import require_vllm

        require_vllm()  # the install hint here, before anything starts
    if run is not None:
        from poolbench.http.leaderboard_route import run_serving

        run_serving(run)  # a bad run folder fails here, before anything starts
    if (state / "cluster.json").exists():
        raise ClusterError(f"a cluster is already up ({state / 'cluster.json'}): run `make cluster-down` first")
    wanted = [("Ray head", ray_port)] + ([("Serve HTTP", serve_port)] if serve else [])
    wanted += [("S3 server", s3_port)] if store.startswith("s3://") else []
    for what, port in wanted:
        if port_in_use(port):
            raise ClusterError(f"port {port} is already in use ({what}): pick another or stop what holds it")
    state.mkdir(parents=True, exist_ok=True)
    _save(state, {"cluster_id": secrets.token_hex(16), "started": time.strftime("%Y-%m-%dT%H:%M:%S")})
    try:
        if store.startswith("s3://"):
            _save(state, {"s3_endpoint": start_s3(store, s3_port, state), "store": store})
        _save(state, start_ray(ray_port, state, num_cpus, cluster_id=_load(state)["cluster_id"], node_ip=ray_host))
        if serve:
            _save(state, {"serve_url": start_serve_app(_load(state), models or ["embedded"], host, serve_port, run,
                                                          steering_backend)})
    except BaseException:
        cluster_down(state)
        raise
    return _load(state)


def cluster_down(state: Path = STATE_DIR) -> list[str]:
    """Stop what cluster-up recorded, gracefully first: Serve (through our head only), Ray's head, the S3 server.

    Returns one line per thing stopped; a recorded pid that is gone, or now names another process, is left alone.
    """
    info = _load(state)
    stopped: list[str] = []
    ray_record = read_pid(state, "ray")
    if info.get("serve_url") and ray_record and is_ours(ray_record["pid"], ray_record["start_ticks"]):
        started = time.monotonic()
        try:
            done = _session("shutdown", info, 60)
        except subprocess.TimeoutExpired:
            done = None
        if done is not None and done.returncode == 0:
            stopped.append(f"serve app on {info['serve_url']} ({time.monotonic() - started:.1f}s)")
        else:
            why = "timed out" if done is None else (done.stderr.strip().splitlines() or ["?"])[-1]
            stopped.append(f"serve app on {info['serve_url']}: not shut down ({why[:160]}); stopping its head")
    for name, what in (("ray", f"ray head {info.get('ray_address', '')}".strip()), ("s3", "s3 server")):
        record = read_pid(state, name)
        if record is None:
            continue
        started = time.monotonic()
        if is_ours(record["pid"], record["start_ticks"]):
            count, graceful = stop_tree(record["pid"], record["start_ticks"])
            how = "graceful" if graceful else "killed after the grace period"
            stopped.append(f"{what} (pid {record['pid']}, {count} processes, {how}, "
                           f"{time.monotonic() - started:.1f}s)")
        (state / f"{name}.pid").unlink()
    if info.get("ray_temp_dir"):
        shutil.rmtree(info["ray_temp_dir"], ignore_errors=True)
    for leftover in ("auth_token", "ray.env", "cluster.json"):
        with contextlib.suppress(FileNotFoundError):
            (state / leftover).unlink()
    return stopped
