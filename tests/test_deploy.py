"""deploy/: every manifest parses, has the fields its tool requires, and agrees with the others on images,
ports and the store's environment variables."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
STORE_ENV = {"POOLBENCH_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"}
RAY_PORT, SERVE_PORT, DASHBOARD_PORT, MINIO_PORT = 6379, 8000, 8265, 9000
IMAGES = {"poolbench/poolbench:cpu", "poolbench/poolbench:cuda"}


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def dockerfile(name: str) -> str:
    return (DEPLOY / name).read_text()


def env_names(container: dict) -> set[str]:
    return {e["name"] for e in container["env"]}


def kuberay_cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles_install_the_package_and_expose_the_ports(name):
    text = dockerfile(name)
    # The base and the torch source are build arguments (an offline build mounts a wheel folder), the package is
    # installed as a wheel (no editable link into a build folder), and the image runs as a non-root user.
    assert re.search(r"^ARG BASE_IMAGE=\S+\nFROM \$\{BASE_IMAGE\}$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/\S+$", text, re.M)
    assert re.search(r"^ARG TORCH_FIND_LINKS=$", text, re.M)
    assert "pip install --no-cache-dir --no-deps ." in text
    assert re.search(r"^USER poolbench$", text, re.M)
    for folder in ("shared", "services"):
        assert f"COPY {folder} ./{folder}" in text
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    assert {RAY_PORT, SERVE_PORT, DASHBOARD_PORT} <= exposed
    assert f"--port={RAY_PORT}" in text


def test_cuda_image_uses_a_cuda_base_and_cuda_torch():
    text = dockerfile("Dockerfile.cuda")
    assert re.search(r"^ARG BASE_IMAGE=docker\.io/nvidia/cuda:\S+$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cu\d+$", text, re.M)
    # Triton's built kernels live in the node's /cache volume (beside the built models), made for the run's user
    assert re.search(r"^ENV .*POOLBENCH_CACHE=/cache .*TRITON_CACHE_DIR=/cache/triton ", text, re.M | re.S)
    assert "install -d -o poolbench -g poolbench /cache" in text


def test_compose_services_images_ports_and_env():
    compose = load("docker-compose.yml")
    services = compose["services"]
    assert {"ray-head", "ray-worker", "minio", "minio-bucket", "driver", "http"} <= set(services)
    head, worker, driver, minio = (services[k] for k in ("ray-head", "ray-worker", "driver", "minio"))
    http = services["http"]
    assert head["image"] == worker["image"] == driver["image"] == http["image"] == "poolbench/poolbench:cpu"
    assert head["build"]["dockerfile"] == "deploy/Dockerfile.cpu"
    # The head publishes Ray's ports; the HTTP service, its own head with the Serve app, publishes Serve's.
    assert f"{RAY_PORT}:{RAY_PORT}" in head["ports"] and f"{SERVE_PORT}:{SERVE_PORT}" in http["ports"]
    assert f"--address=ray-head:{RAY_PORT}" in worker["command"]
    assert worker["deploy"]["replicas"] >= 1  # scaled with --scale ray-worker=N
    # A Ray driver must run on a Ray node: the driver container joins the head first, then runs on `auto`.
    assert f"--address=ray-head:{RAY_PORT}" in " ".join(driver["entrypoint"])
    assert driver["command"][:4] == ["poolbench-driver", "run", "--address", "auto"]
    # MinIO: a healthcheck on its port, a bucket made once it is healthy, credentials that match the clients.
    assert f"{MINIO_PORT}:{MINIO_PORT}" in minio["ports"]
    assert str(MINIO_PORT) in " ".join(minio["healthcheck"]["test"])
    bucket_job = services["minio-bucket"]
    assert bucket_job["depends_on"]["minio"]["condition"] == "service_healthy"
    assert "mc mb" in " ".join(bucket_job["entrypoint"])
    for svc in (head, worker, driver):
        env = svc["environment"]
        assert set(env) >= STORE_ENV
        assert env["POOLBENCH_S3_ENDPOINT"] == f"http://minio:{MINIO_PORT}"
        assert env["AWS_ACCESS_KEY_ID"] == minio["environment"]["MINIO_ROOT_USER"]
        assert env["AWS_SECRET_ACCESS_KEY"] == minio["environment"]["MINIO_ROOT_PASSWORD"]
        bucket = env["POOLBENCH_STORE"].removeprefix("s3://").split("/")[0]
        assert f"local/{bucket}" in " ".join(bucket_job["entrypoint"])
    assert "--store" in driver["command"] and head["environment"]["POOLBENCH_STORE"] in driver["command"]
    assert head["depends_on"]["minio-bucket"]["condition"] == "service_completed_successfully"


@pytest.mark.parametrize("name", ["kuberay/raycluster.yaml", "kuberay/rayjob.yaml"])
def test_kuberay_manifests_have_a_gpu_worker_group(name):
    doc = load(name)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in ("RayCluster", "RayJob")
    spec = kuberay_cluster_spec(doc)
    import ray

    assert spec["rayVersion"] == ray.__version__
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] in IMAGES
    assert {p["containerPort"] for p in head["ports"]} >= {RAY_PORT, DASHBOARD_PORT, SERVE_PORT}
    assert env_names(head) >= STORE_ENV
    gpu = [g for g in spec["workerGroupSpecs"] if g["groupName"] == "gpu"]
    assert len(gpu) == 1 and gpu[0]["rayStartParams"]["num-gpus"] == "1"
    assert gpu[0]["minReplicas"] <= gpu[0]["replicas"] <= gpu[0]["maxReplicas"]
    worker = gpu[0]["template"]["spec"]["containers"][0]
    assert worker["image"] == "poolbench/poolbench:cuda"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert env_names(worker) == env_names(head)
    secrets = [e for e in head["env"] if "valueFrom" in e]
    # never inline
    assert {e["name"] for e in secrets} == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "POOLBENCH_TOKEN"}
    if doc["kind"] == "RayJob":
        assert doc["spec"]["entrypoint"].startswith("poolbench-driver run --address auto")


def test_kuberay_job_and_cluster_agree():
    cluster, job = load("kuberay/raycluster.yaml"), kuberay_cluster_spec(load("kuberay/rayjob.yaml"))
    assert cluster["spec"]["headGroupSpec"] == job["headGroupSpec"]
    assert cluster["spec"]["workerGroupSpecs"] == job["workerGroupSpecs"]


def test_ray_up_yaml_and_env_agree_with_compose():
    doc = load("ray-cluster.yaml")
    for field in ("cluster_name", "provider", "auth", "head_start_ray_commands", "worker_start_ray_commands"):
        assert field in doc
    assert doc["docker"]["image"] == "poolbench/poolbench:cuda"
    head_cmd, worker_cmd = " ".join(doc["head_start_ray_commands"]), " ".join(doc["worker_start_ray_commands"])
    assert f"--port={RAY_PORT}" in head_cmd and f":{RAY_PORT}" in worker_cmd and "--num-gpus=1" in worker_cmd
    compose_env = load("docker-compose.yml")["services"]["ray-head"]["environment"]
    for cmd in (head_cmd, worker_cmd):
        assert f"POOLBENCH_STORE={compose_env['POOLBENCH_STORE']}" in cmd
        assert "POOLBENCH_S3_ENDPOINT=http://" in cmd and f":{MINIO_PORT}" in cmd
        assert f"AWS_REGION={compose_env['AWS_REGION']}" in cmd
    assert "AWS_SECRET_ACCESS_KEY=" not in (DEPLOY / "ray-cluster.yaml").read_text()


def test_every_image_named_anywhere_is_one_the_dockerfiles_build():
    named = set()
    for name in ("docker-compose.yml", "kuberay/raycluster.yaml", "kuberay/rayjob.yaml", "ray-cluster.yaml"):
        named |= set(re.findall(r"poolbench/poolbench:[\w.-]+", (DEPLOY / name).read_text()))
    assert named == IMAGES
    assert {f"Dockerfile.{tag.split(':')[1]}" for tag in named} <= {p.name for p in DEPLOY.iterdir()}
