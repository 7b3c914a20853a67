"""The rendered manifests as the tests read them: `kubectl kustomize` of each overlay (with the optional
components), the pods every object makes, the service each container runs and the settings it gets."""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import shlex
import shutil
import subprocess
import tempfile

import pytest
import yaml

from coordinator.settings import CoordinatorSettings
from draft_service.settings import DraftSettings
from specdec.cli import SERVICE_MODULES
from specdec.common.settings import parse_settings
from verify_service.settings import VerifySettings

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "k8s"
OVERLAYS = sorted(path.parent.name for path in (K8S_DIR / "overlays").glob("*/kustomization.yaml"))
MONITORING = "+monitoring"  # an overlay with k8s/components/monitoring added, as an operator would
# Every overlay, the GPU ones with the monitoring component, and the GPU one with each other optional component.
VARIANTS = [
    *OVERLAYS,
    *(overlay + MONITORING for overlay in OVERLAYS if overlay.startswith("gpu")),
    "gpu+cert-manager",
    "gpu+models-volume-owner",
]
_spec = importlib.util.spec_from_file_location("k8s_secrets", ROOT / "scripts" / "k8s_secrets.py")
k8s_secrets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(k8s_secrets)
NAMESPACE = "specdec"
SETTINGS = {"coordinator": CoordinatorSettings, "draft_service": DraftSettings, "verify_service": VerifySettings}
IMAGE = "specdec"  # the repository's Dockerfile; containers of other images (redis) run no service
KUBERAY_CONTAINERS = ("ray-head", "ray-worker")  # Ray nodes; the head may also exec a service
# Containers of the image that run a tool, not a service: (what their script runs, the module or repository
# file it needs, the SPECDEC_* variables the tool reads; those are settings of the coordinator).
TOOLS = {
    "seed-api-keys": (
        "python -m coordinator.api_keys add",
        "coordinator.api_keys",
        {"SPECDEC_REDIS_URL", "SPECDEC_REDIS_KEY_PREFIX"},
    ),
    "fetch-models": ("python /app/scripts/fetch_model.py", "scripts/fetch_model.py", set()),
    "own-models-volume": ("chown 10001:10001 /models", None, set()),  # components/models-volume-owner
}
IMAGE_WORKDIR = "/app"  # the Dockerfile's WORKDIR, where `COPY . .` puts the repository


def kustomize(directory: pathlib.Path) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot run `kubectl kustomize` to render the overlays")
    done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return done.stdout


@functools.cache
def render(variant: str, k8s_dir: pathlib.Path = K8S_DIR) -> tuple[dict, ...]:
    """The objects of an overlay; `NAME+COMPONENT` adds k8s/components/COMPONENT on top of overlay NAME, as an
    operator would. k8s_dir: another copy of k8s/ (a test's edited one)."""
    overlay, _, component = variant.partition("+")
    if not component:
        return tuple(obj for obj in yaml.safe_load_all(kustomize(k8s_dir / "overlays" / overlay)) if obj)
    return render_on_top(overlay, {}, [component], k8s_dir)


def render_on_top(overlay: str, fields: dict, components: list[str], k8s_dir: pathlib.Path = K8S_DIR) -> tuple:
    """The objects of a kustomization of an operator's own on top of an overlay: `fields` of its own
    (configMapGenerator, ...) and k8s/components/NAME for each of `components`, listed after them."""
    with tempfile.TemporaryDirectory() as scratch:  # kustomize wants relative paths
        relative = pathlib.Path(os.path.relpath(k8s_dir, scratch))
        (pathlib.Path(scratch) / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "namespace": NAMESPACE,
                    "resources": [str(relative / "overlays" / overlay)],
                    **fields,
                    "components": [str(relative / "components" / name) for name in components],
                }
            )
        )
        return tuple(obj for obj in yaml.safe_load_all(kustomize(pathlib.Path(scratch))) if obj)


def pod_templates(obj: dict) -> list[tuple[str, dict]]:
    """(where, pod template) for each pod the object creates."""
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return [(where, obj["spec"]["template"])]
    if obj["kind"] == "RayCluster":
        groups = [
            (f"{where} head", obj["spec"]["headGroupSpec"]["template"]),
            *((f"{where} {group['groupName']}", group["template"]) for group in obj["spec"]["workerGroupSpecs"]),
        ]
        ray_label = {"ray.io/cluster": obj["metadata"]["name"]}  # what KubeRay labels the pods with
        return [
            (w, {**t, "metadata": {**t["metadata"], "labels": {**t["metadata"]["labels"], **ray_label}}})
            for w, t in groups
        ]
    return []


def all_pods(objects) -> list[tuple[str, dict, dict]]:
    """(where, pod template, owning object) over the whole render."""
    return [(where, template, obj) for obj in objects for where, template in pod_templates(obj)]


def named(objects, kind: str, name: str) -> dict | None:
    return next((o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name), None)


def final_argv(container: dict) -> list[str]:
    """What the container ends up running: for a shell wrapper (`bash -c "...; exec python -m ..."`), the
    command after its last `exec` (within `eval "exec $CMD"` too)."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv and pathlib.PurePath(argv[0]).name in ("sh", "bash"):
        script = argv[-1]
        argv = shlex.split(script.rpartition("exec ")[2].rstrip('"')) if "exec " in script else []
    return argv


def service_of(container: dict) -> tuple[str, list[str]] | None:
    """(settings package, flags) of a container that runs one of the services, None for any other."""
    argv = final_argv(container)
    if container["image"].split("@")[0].split(":")[0].rsplit("/", 1)[-1] != IMAGE or container["name"] in TOOLS:
        return None
    if container["name"] in KUBERAY_CONTAINERS and argv[:1] in ([], ["$KUBERAY_GEN_RAY_START_CMD"]):
        return None  # a Ray node only
    assert argv[:2] in (["python", "-m"], ["python3", "-m"]) and len(argv) > 2, (
        f"container {container['name']}: command must be `python -m <service>`, got {argv}"
    )
    module, rest = argv[2], argv[3:]
    if module == "specdec":
        assert rest[:1] == ["serve"] and len(rest) > 1 and rest[1] in SERVICE_MODULES, (
            f"container {container['name']}: `python -m specdec` needs `serve {'|'.join(SERVICE_MODULES)}`, got {rest}"
        )
        module, rest = SERVICE_MODULES[rest[1]], rest[2:]
    assert importlib.util.find_spec(module) is not None, f"container {container['name']}: no module {module}"
    package = module.split(".")[0]
    assert package in SETTINGS, f"container {container['name']}: {module} is not a service entry point"
    return package, rest


def secret_contract() -> list[dict]:
    """The Secrets the manifests read, as scripts/k8s_secrets.py makes them (they are not in the render, so that
    applying never overwrites them); a Secret of no fixed keys (specdec-api-keys) holds any client names."""
    return [
        {"kind": "Secret", "metadata": {"name": name}, "data": dict.fromkeys(keys, ""), "anyKeys": not keys}
        for name, keys in k8s_secrets.SECRET_KEYS.items()
    ]


def with_secrets(objects) -> list[dict]:
    return [*objects, *secret_contract()]


def container_env(objects, container: dict) -> tuple[dict[str, str | None], list[str]]:
    """Every variable the container gets (value None when it comes from a secret or the downward API), and
    the references to objects missing from the render (or from the Secrets scripts/k8s_secrets.py makes)."""
    objects = with_secrets(objects)
    env: dict[str, str | None] = {}
    missing = []
    for source in container.get("envFrom", []):
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in source:
                obj = named(objects, kind, source[key]["name"])
                if obj is None:
                    if not source[key].get("optional"):
                        missing.append(f"{kind} {source[key]['name']}")
                    continue
                data = {**obj.get("data", {}), **obj.get("stringData", {})}
                if kind == "Secret":
                    data = {name: None for name in data}
                env.update({source.get("prefix", "") + name: value for name, value in data.items()})
    for var in container.get("env", []):
        env[var["name"]] = var.get("value")
        for kind, key in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
            ref = var.get("valueFrom", {}).get(key)
            if ref:
                obj = named(objects, kind, ref["name"])
                data = {**obj.get("data", {}), **obj.get("stringData", {})} if obj else {}
                if ref["key"] not in data and not ref.get("optional"):
                    missing.append(f"{kind} {ref['name']} key {ref['key']}")
                env[var["name"]] = data.get(ref["key"]) if kind == "ConfigMap" else None
    return env, missing


def services(objects):
    """(where, pod template, owner, container, settings object) for each container running a service."""
    for where, template, owner in all_pods(objects):
        for container in template["spec"]["containers"]:
            found = service_of(container)
            if found:
                package, flags = found
                env, _ = container_env(objects, container)
                known = {name: value for name, value in env.items() if value is not None}
                yield where, template, owner, container, parse_settings(SETTINGS[package], flags, environ=known)


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        value, operator = labels.get(expression["key"]), expression["operator"]
        if (
            (operator == "In" and value not in expression["values"])
            or (operator == "NotIn" and value in expression.get("values", []))
            or (operator == "Exists" and value is None)
            or (operator == "DoesNotExist" and value is not None)
        ):
            return False
    return True
