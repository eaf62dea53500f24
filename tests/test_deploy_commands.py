"""deploy/ and docs/cluster.md (README's "On your cluster") run what the code has: every `poolbench-driver`
command they name is a command of the Typer app with options it declares, every environment variable they set is
one PoolBench (or Ray) reads, and all of them agree on the variables, the store and the `run --address` command
the tests run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
import yaml

from poolbench.cli.app import app
from poolbench.driver.extractor_fleet import FORWARDED_ENV

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CLI = typer.main.get_command(app)
RAYS_OWN = {"RAY_ADDRESS"}  # read by Ray itself (`--address auto`)
WORKERS_NEED = set(FORWARDED_ENV) - {"HF_HOME", "HF_HUB_OFFLINE"}  # the store and cache, forwarded to every worker


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def cluster_page() -> str:
    """docs/cluster.md, which README's "On your cluster" section links."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/cluster.md)" in readme.split("## On your cluster\n", 1)[1].split("\n## ", 1)[0]
    return (ROOT / "docs" / "cluster.md").read_text(encoding="utf-8")


def unknown_options(argv: list[str]) -> list[str]:
    """The `--options` of a `poolbench-driver …` command line that its Typer command does not declare (a word that
    names no command is returned too)."""
    assert argv[0] == "poolbench-driver"
    node, rest = CLI, argv[1:]
    while isinstance(getattr(node, "commands", None), dict) and rest:
        sub = node.commands.get(rest[0])  # type: ignore[attr-defined]
        if sub is None:
            return [rest[0]]
        node, rest = sub, rest[1:]
    declared = {opt for param in node.params for opt in (*param.opts, *getattr(param, "secondary_opts", []))}
    return [word.split("=")[0] for word in rest if word.startswith("--") and word.split("=")[0] not in declared]


def driver_commands() -> dict[str, list[str]]:
    """Every `poolbench-driver` command line deploy/ and docs/cluster.md name, by where it is."""
    found = {"docker-compose driver": load("docker-compose.yml")["services"]["driver"]["command"],
             "KubeRay RayJob": shlex.split(load("kuberay/rayjob.yaml")["spec"]["entrypoint"])}
    for i, line in enumerate(re.findall(r"^poolbench-driver .+$", cluster_page(), re.M)):
        found[f"docs/cluster.md line {i}"] = shlex.split(line)
    return found


def env_code_reads() -> set[str]:
    """Every quoted UPPER_CASE name in PoolBench's source: the environment variables it can read or forward."""
    names: set[str] = set()
    for folder in ("shared", "services"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r"\"([A-Z][A-Z0-9]*_[A-Z0-9_]+)\"", path.read_text(encoding="utf-8")))
    return names


def manifest_env() -> dict[str, set[str]]:
    compose = load("docker-compose.yml")["services"]
    kuberay = {}
    for name in ("raycluster.yaml", "rayjob.yaml"):
        doc = load(f"kuberay/{name}")
        spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        for group in groups:
            for container in group["template"]["spec"]["containers"]:
                kuberay[f"{name} {container['name']}"] = {e["name"] for e in container["env"]}
    readme = set(re.findall(r"(?:export |\s)([A-Z][A-Z0-9_]+)=", cluster_page()))
    ray_up = set(re.findall(r"\b([A-Z][A-Z0-9_]+)=", " ".join(load("ray-cluster.yaml")["head_start_ray_commands"])))
    return {**{f"compose {k}": set(compose[k]["environment"]) for k in ("ray-head", "ray-worker", "driver")},
            **kuberay, "docs/cluster.md": readme, "ray-cluster.yaml": ray_up}


@pytest.mark.parametrize("where", sorted(driver_commands()))
def test_every_command_names_options_the_app_declares(where):
    argv = driver_commands()[where]
    assert unknown_options(argv) == [], f"{where}: {shlex.join(argv)}"


def test_the_check_catches_an_option_or_command_that_does_not_exist():
    assert unknown_options(["poolbench-driver", "run", "--adress", "auto", "--store=s3://b/p"]) == ["--adress"]
    assert unknown_options(["poolbench-driver", "cluster", "up", "--token", "t"]) == []
    assert unknown_options(["poolbench-driver", "launch", "--address", "auto"]) == ["launch"]


def test_every_run_joins_the_cluster_and_stores_to_the_same_s3_store():
    store = load("docker-compose.yml")["services"]["ray-head"]["environment"]["POOLBENCH_STORE"]
    assert store.startswith("s3://")  # a local folder is refused on a cluster of several nodes
    for where, argv in driver_commands().items():
        assert argv[:2] == ["poolbench-driver", "run"], where
        options = dict(zip(argv[2::2], argv[3::2], strict=False))
        assert options["--store"] == store, where
        assert options["--address"] == "auto", where  # on a node of the cluster (the compose driver joins first)


def test_every_variable_set_is_one_the_code_reads_and_workers_get_the_store_and_cache():
    reads = env_code_reads() | RAYS_OWN
    for where, names in manifest_env().items():
        assert names - reads == set(), where
        assert names >= WORKERS_NEED or where == "ray-cluster.yaml", where  # ray up: secrets exported by hand
    envs = manifest_env()
    poolbench = envs["compose ray-head"]
    assert envs["docs/cluster.md"] == poolbench
    assert all(envs[k] == poolbench for k in envs if k.startswith(("raycluster", "rayjob")))
    assert envs["compose driver"] == poolbench | {"RAY_ADDRESS"}
    assert "POOLBENCH_TOKEN" in poolbench
