"""deploy/kuberay validates against KubeRay's own CRD schemas (v1.7.0, vendored in tests/data/kuberay), the way a
cluster with strict field validation (kubectl's default) would take it: unknown fields are errors except where the
schema keeps unknown fields; the manifests run the image `make image` tags and name the compose stack's variables
and command. No Kubernetes runs here: this is the whole of what is tested of the KubeRay path."""

from __future__ import annotations

import copy
import gzip
import json
import shlex
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft7Validator

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "tests" / "data" / "kuberay"
KUBERAY_VERSION = "v1.7.0"
MANIFESTS = {"raycluster.yaml": "ray.io_rayclusters.v1.schema.json.gz",
             "rayjob.yaml": "ray.io_rayjobs.v1.schema.json.gz"}


def strict(schema: dict) -> dict:
    """The schema with `additionalProperties: false` wherever it lists properties and does not keep unknown
    fields (`x-kubernetes-preserve-unknown-fields`): a misspelt field fails, as the API server's strict mode does."""
    out = copy.deepcopy(schema)

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(out)
    return out


def validator(schema_file: str) -> Draft7Validator:
    with gzip.open(SCHEMAS / schema_file, "rt", encoding="utf-8") as f:
        return Draft7Validator(strict(json.load(f)))


def manifest(name: str) -> dict:
    return yaml.safe_load((ROOT / "deploy" / "kuberay" / name).read_text())


def errors(name: str, doc: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator(MANIFESTS[name]).iter_errors(doc)]


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_the_manifest_validates_against_the_kuberay_crd_schema(name):
    doc = manifest(name)
    assert doc["apiVersion"] == "ray.io/v1"
    assert f"tag **{KUBERAY_VERSION}**" in (SCHEMAS / "README.md").read_text()  # the schemas' named source
    assert errors(name, doc) == []


def test_a_misspelt_field_or_a_wrong_type_fails_validation():
    """Should-fail: the check is not a schema that accepts anything."""
    typo = manifest("raycluster.yaml")
    typo["spec"]["workerGroupSpec"] = typo["spec"].pop("workerGroupSpecs")
    assert any("workerGroupSpec" in e for e in errors("raycluster.yaml", typo))
    wrong_type = manifest("rayjob.yaml")
    wrong_type["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert any("replicas" in e and "'two'" in e for e in errors("rayjob.yaml", wrong_type))
    bad_container = manifest("raycluster.yaml")
    bad_container["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imag"] = "x"
    assert any("imag" in e for e in errors("raycluster.yaml", bad_container))


def containers(doc: dict) -> list[dict]:
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_the_manifests_run_the_image_make_image_tags_with_the_compose_variables_and_command():
    """`make image FLAVOR=cuda` tags poolbench/poolbench:cuda (deploy/image.sh); the pods carry the compose head's
    variables (S3 endpoint aside, each names its own) and the RayJob runs the compose driver's command."""
    image_script = (ROOT / "deploy" / "image.sh").read_text()
    assert 'IMAGE=${IMAGE:-poolbench/poolbench:$FLAVOR}' in image_script
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())["services"]
    compose_env = compose["ray-head"]["environment"]
    for name in MANIFESTS:
        for container in containers(manifest(name)):
            assert container["image"] == "poolbench/poolbench:cuda", (name, container["name"])
            assert (ROOT / "deploy" / "Dockerfile.cuda").is_file()
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert set(env) == set(compose_env), (name, container["name"])
            for key in ("POOLBENCH_STORE", "POOLBENCH_CACHE", "AWS_REGION"):
                assert env[key] == compose_env[key], (name, key)
    job = shlex.split(manifest("rayjob.yaml")["spec"]["entrypoint"])
    driver = compose["driver"]["command"]
    assert job[:3] == driver[:3] == ["poolbench-driver", "run", "--address"]
    assert job[job.index("--store") + 1] == driver[driver.index("--store") + 1] == compose_env["POOLBENCH_STORE"]
