"""deploy/kubernetes/ checked offline: built by kustomize's own rules (`kubectl kustomize`, where
kubectl is installed), every object validated field by field against the official `kubernetes`
client's models (an unknown or misspelt field, a wrong type or a missing required field fails),
and the containers' arguments parsed by `chunkcache serve`'s and `chunkcache route`'s own parsers
and configs, with the ConfigMap's values and the pod name substituted as Kubernetes does."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from chunkcache.config import EngineConfig
from chunkcache.engine_args import engine_options
from chunkcache.router.app import add_route_arguments, config_from_args
from chunkcache.server.cli import add_serve_arguments

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client validates the manifests")
from kubernetes import client  # noqa: E402

BASE = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
_PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}


def _documents() -> list[dict[str, Any]]:
    if shutil.which("kubectl") is not None:
        out = subprocess.run(["kubectl", "kustomize", str(BASE)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    # Without kubectl: the resources the kustomization lists, as they are.
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [
        d for name in kustomization["resources"] for d in yaml.safe_load_all((BASE / name).read_text()) if d
    ]


def _check(value: Any, type_name: str, path: str) -> None:
    """`value` against the client's OpenAPI type `type_name`: unknown fields and wrong types fail."""
    if type_name.lower().startswith("list["):
        assert isinstance(value, list), f"{path}: expected a list"
        for i, item in enumerate(value):
            _check(item, type_name[5:-1], f"{path}[{i}]")
        return
    if type_name.lower().startswith(("dict(", "dict[")):
        assert isinstance(value, dict), f"{path}: expected a map"
        inner = type_name[5:-1].split(", ", 1)[1]
        for key, item in value.items():
            _check(item, inner, f"{path}.{key}")
        return
    if type_name in _PRIMITIVES:
        assert isinstance(value, _PRIMITIVES[type_name]), f"{path}: expected {type_name}, got {value!r}"
        return
    cls = getattr(client.models, type_name)
    assert isinstance(value, dict), f"{path}: expected a {type_name} object"
    by_json = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    for key, item in value.items():
        assert key in by_json, f"{path}: {type_name} has no field {key!r}"
        _check(item, cls.openapi_types[by_json[key]], f"{path}.{key}")


def _validate(doc: dict[str, Any]) -> Any:
    version = doc["apiVersion"].rpartition("/")[2]
    type_name = f"{version.capitalize()}{doc['kind']}"
    assert hasattr(client.models, type_name), f"{doc['kind']} {doc['apiVersion']}: no such API type"
    _check(doc, type_name, f"{doc['kind']}/{doc['metadata']['name']}")
    # Required fields: the models refuse a missing one when built (client-side validation).
    return client.ApiClient()._ApiClient__deserialize(doc, type_name)


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in _documents()}


def test_manifests_validate_against_the_kubernetes_api(docs: dict[tuple[str, str], dict[str, Any]]) -> None:
    assert set(docs) == {
        ("ConfigMap", "chunkcache-shared"),
        ("Deployment", "chunkcache-redis"),
        ("Service", "chunkcache-redis"),
        ("Service", "chunkcache-replica"),
        ("StatefulSet", "chunkcache-replica"),
        ("Deployment", "chunkcache-router"),
        ("Service", "chunkcache-router"),
        ("ServiceAccount", "chunkcache-router"),
        ("Role", "chunkcache-router-discovery"),
        ("RoleBinding", "chunkcache-router-discovery"),
    }
    for doc in docs.values():
        _validate(doc)


def test_the_validator_catches_mistakes(docs: dict[tuple[str, str], dict[str, Any]]) -> None:
    import copy

    bad = copy.deepcopy(docs[("StatefulSet", "chunkcache-replica")])
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # misspelt
    with pytest.raises(AssertionError, match="readinesProbe"):
        _validate(bad)
    bad = copy.deepcopy(docs[("Service", "chunkcache-router")])
    del bad["spec"]["ports"][0]["port"]  # required
    with pytest.raises(ValueError, match="port"):
        _validate(bad)


def _services_select_pods(docs: dict[tuple[str, str], dict[str, Any]]) -> None:
    pods = [
        d["spec"]["template"]["metadata"]["labels"] for d in docs.values() if "template" in d.get("spec", {})
    ]
    for (kind, name), doc in docs.items():
        if kind == "Service":
            selector = doc["spec"]["selector"]
            assert any(selector.items() <= labels.items() for labels in pods), (
                f"Service {name} selects no pod"
            )


def _substitute(args: list[str], env: dict[str, str]) -> list[str]:
    """$(VAR) as Kubernetes expands it in command and args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]["containers"][0]


def test_services_probes_and_arguments_agree(docs: dict[tuple[str, str], dict[str, Any]]) -> None:
    _services_select_pods(docs)
    shared = docs[("ConfigMap", "chunkcache-shared")]["data"]
    replicas = docs[("StatefulSet", "chunkcache-replica")]
    serve = _container(replicas)
    assert (
        serve["readinessProbe"]["httpGet"]["path"] == serve["livenessProbe"]["httpGet"]["path"] == "/health"
    )
    names = [f"chunkcache-replica-{i}" for i in range(replicas["spec"]["replicas"])]
    # Each replica's arguments are what `chunkcache serve` accepts, and a valid engine configuration.
    argv = _substitute(serve["args"], {**shared, "POD_NAME": names[0]})
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(argv)
    config = EngineConfig.from_options(args.model, use_env=False, **engine_options(args))
    assert config.kv_events.topic == f"kv@{names[0]}@{shared['MODEL_NAME']}"
    ports = {p["name"]: p["containerPort"] for p in serve["ports"]}
    assert args.port == ports["http"] and config.kv_events.replay_endpoint.endswith(f":{ports['kv-replay']}")
    # The router's: the replicas are discovered by their pods' label, at their named ports.
    router = docs[("Deployment", "chunkcache-router")]
    argv = _substitute(_container(router)["args"], shared)
    parser = argparse.ArgumentParser()
    add_route_arguments(parser)
    args = parser.parse_args(argv)
    args.tokenizer = "unused"  # the model is not installed here: only the options are checked
    route = config_from_args(args)
    assert route.backends == () and route.discovery is not None
    key, _, value = route.discovery.selector.partition("=")
    assert replicas["spec"]["template"]["metadata"]["labels"][key] == value
    assert route.discovery.http_port in ports and route.discovery.replay_port in ports
    assert route.discovery.events_port is None and route.events_bind is not None  # replicas connect
    assert route.model_name == shared["MODEL_NAME"]
    key_files = [
        i["path"]
        for v in router["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "curve-replicas"
        for i in v["secret"]["items"]
    ]
    assert key_files == [f"{n}.key" for n in names]
    events_port = {p["name"]: p["port"] for p in docs[("Service", "chunkcache-router")]["spec"]["ports"]}[
        "kv-events"
    ]
    assert config.kv_events.endpoint == f"tcp://chunkcache-router:{events_port}"


def test_the_router_may_watch_pods_and_nothing_more(docs: dict[tuple[str, str], dict[str, Any]]) -> None:
    account = docs[("Deployment", "chunkcache-router")]["spec"]["template"]["spec"]["serviceAccountName"]
    assert ("ServiceAccount", account) in docs
    role = docs[("Role", "chunkcache-router-discovery")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = docs[("RoleBinding", "chunkcache-router-discovery")]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "chunkcache-router-discovery",
    }
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [("ServiceAccount", account)]
    # The hint the router logs on 403 names this Role and this file.
    from chunkcache.router.discovery import RBAC_HINT

    assert "rbac.yaml" in RBAC_HINT and role["metadata"]["name"] in RBAC_HINT


# --- the image (no docker daemon here: the Dockerfile is linted and checked against the rest) ---

ROOT = BASE.parents[1]


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_dockerfile_agrees_with_setup_and_manifests(docs: dict[tuple[str, str], dict[str, Any]]) -> None:
    text = _dockerfile()
    # The torch scripts/setup.sh pins, installed before the project.
    pinned = re.search(r'"torch==([\d.]+)"', (ROOT / "scripts" / "setup.sh").read_text())
    assert pinned is not None and f"ARG TORCH_VERSION={pinned.group(1)}\n" in text
    assert text.index('"torch==${TORCH_VERSION}"') < text.index('pip install "/tmp/src[kubernetes]"')
    # The manifests run the image's user, and their commands are the image's entry point.
    user = re.search(r"^USER (\d+)$", text, re.M)
    assert user is not None and 'ENTRYPOINT ["chunkcache"]' in text
    for kind, name in (("StatefulSet", "chunkcache-replica"), ("Deployment", "chunkcache-router")):
        spec = docs[(kind, name)]["spec"]["template"]["spec"]
        assert (
            spec["securityContext"]["runAsUser"] == int(user.group(1)) == spec["securityContext"]["fsGroup"]
        )
        for c in spec["initContainers"] + spec["containers"]:
            assert c["image"].partition(":")[0] == "chunkcache" and c["command"][0] == "chunkcache"
    # Every COPY source from the context survives .dockerignore (which excludes everything else);
    # a COPY --from=STAGE reads the stage, not the context.
    lines = (line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines())
    ignore = [line for line in lines if line and not line.startswith("#")]
    assert ignore[0] == "*"
    for sources in re.findall(r"^COPY (?!.*--from=)(?:--\S+ )*(.+) \S+$", text, re.M):
        for source in sources.split():
            assert f"!{source}" in ignore or f"!{source}/" in ignore, source


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is not installed")
def test_dockerfile_passes_hadolint() -> None:
    out = subprocess.run(["hadolint", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _cpus(quantity: str) -> float:
    """A Kubernetes CPU quantity ("4", "500m") in CPUs."""
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_each_replica_gets_its_cpu_share_and_threads_follow_it(
    docs: dict[tuple[str, str], dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica's CPU limit (its cgroup quota) is whole CPUs, equal to its request, and nothing
    pins the engine's threads, so they follow the quota: on a node of 16 cores, as many threads as
    the limit's CPUs (threads.py, read from the cgroup v2 tree the kubelet would make)."""
    import os

    from chunkcache.threads import default_threads

    serve = _container(docs[("StatefulSet", "chunkcache-replica")])
    resources = serve["resources"]
    limit = _cpus(str(resources["limits"]["cpu"]))
    assert limit == int(limit) >= 1 and _cpus(str(resources["requests"]["cpu"])) == limit
    shared = docs[("ConfigMap", "chunkcache-shared")]["data"]
    pinned = {"OMP_NUM_THREADS", "CHUNKCACHE_THREADS"}
    assert not pinned & {*shared, *(e["name"] for e in serve.get("env", []))}
    assert not any(a.startswith("--threads") for a in serve["args"])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    files = {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": f"{int(limit * 100000)} 100000\n"}
    for cpu in range(16):
        topology = f"sys/devices/system/cpu/cpu{cpu}/topology"
        files |= {f"{topology}/physical_package_id": "0\n", f"{topology}/core_id": f"{cpu}\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert default_threads(tmp_path)[0] == int(limit)
