"""The Kubernetes manifests: every overlay renders, every object passes strict schema validation, and every
container's command, flags and SPECDEC_* variables are ones the services' real entry points accept, so the
manifests cannot drift from the code."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib
import shlex
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from coordinator.settings import CoordinatorSettings
from draft_service.settings import DraftSettings
from specdec.cli import SERVICE_MODULES
from specdec.settings import env_name, parse_settings, settings_parser
from verify_service.settings import VerifySettings

K8S_DIR = pathlib.Path(__file__).resolve().parents[2] / "k8s"
OVERLAYS = sorted(path.parent.name for path in (K8S_DIR / "overlays").glob("*/kustomization.yaml"))
# 1.30 is the oldest release the manifests target (preStop `sleep` on by default); the newest is current.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
SETTINGS = {"coordinator": CoordinatorSettings, "draft_service": DraftSettings, "verify_service": VerifySettings}
IMAGE = "specdec"  # the repository's Dockerfile; containers of other images (redis) run no service
KUBERAY_CONTAINERS = ("ray-head", "ray-worker")  # Ray nodes; the head may also exec a service


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot run `kubectl kustomize` to render the overlays")
    done = subprocess.run(
        [kubectl, "kustomize", str(K8S_DIR / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"kubectl kustomize {overlay} failed:\n{done.stderr}"
    return tuple(obj for obj in yaml.safe_load_all(done.stdout) if obj)


@pytest.fixture(params=OVERLAYS)
def overlay(request) -> str:
    return request.param


def pod_templates(obj: dict) -> list[tuple[str, dict]]:
    """(where, pod template) for each pod the object creates."""
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return [(where, obj["spec"]["template"])]
    if obj["kind"] == "RayCluster":
        return [
            (f"{where} head", obj["spec"]["headGroupSpec"]["template"]),
            *((f"{where} {group['groupName']}", group["template"]) for group in obj["spec"]["workerGroupSpecs"]),
        ]
    return []


def all_pods(objects) -> list[tuple[str, dict, dict]]:
    """(where, pod template, owning object) over the whole render."""
    return [(where, template, obj) for obj in objects for where, template in pod_templates(obj)]


def named(objects, kind: str, name: str) -> dict | None:
    return next((o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name), None)


def final_argv(container: dict) -> list[str]:
    """What the container ends up running: for a shell wrapper (`bash -c "...; exec python -m ..."`), the
    command after its last `exec`."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv and pathlib.PurePath(argv[0]).name in ("sh", "bash"):
        script = argv[-1]
        argv = shlex.split(script.rpartition("exec ")[2]) if "exec " in script else []
    return argv


def service_of(container: dict) -> tuple[str, list[str]] | None:
    """(settings package, flags) of a container that runs one of the services, None for any other."""
    argv = final_argv(container)
    if container["image"].split("@")[0].split(":")[0].rsplit("/", 1)[-1] != IMAGE:
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


def container_env(objects, container: dict) -> tuple[dict[str, str | None], list[str]]:
    """Every variable the container gets (value None when it comes from a secret or the downward API), and
    the references to objects missing from the render."""
    env: dict[str, str | None] = {}
    missing = []
    for source in container.get("envFrom", []):
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in source:
                obj = named(objects, kind, source[key]["name"])
                if obj is None:
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


def test_the_issue_overlays_exist():
    assert {"cpu-demo", "gpu"} <= set(OVERLAYS), OVERLAYS


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_passes_strict_validation(overlay, version):
    failures = []
    for obj in render(overlay):
        # A custom resource has no schema here: validate the pods it makes as Pods instead.
        checked = (
            [
                {"apiVersion": "v1", "kind": "Pod", "metadata": t.get("metadata", {}), "spec": t["spec"]}
                for _, t in pod_templates(obj)
            ]
            if obj["kind"] == "RayCluster"
            else [obj]
        )
        for resource in checked:
            try:
                kubernetes_validate.validate(resource, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {error.path}: {error.message}")
            except kubernetes_validate.SchemaNotFoundError:
                failures.append(f"{obj['kind']}/{obj['metadata']['name']}: no schema for {obj['apiVersion']}")
    assert not failures, "\n".join(failures)


def test_containers_run_real_entry_points_with_real_settings(overlay):
    objects = render(overlay)
    failures, seen = [], set()
    for where, template, _ in all_pods(objects):
        for container in template["spec"].get("initContainers", []) + template["spec"]["containers"]:
            label = f"{where} container {container['name']}"
            env, missing = container_env(objects, container)
            failures += [f"{label}: references missing {ref}" for ref in missing]
            try:
                found = service_of(container)
            except AssertionError as error:
                failures.append(f"{label}: {error}")
                continue
            specdec_vars = sorted(name for name in env if name.startswith("SPECDEC_"))
            if found is None:
                failures += [f"{label}: runs no service but sets {name}" for name in specdec_vars]
                continue
            package, flags = found
            cls = SETTINGS[package]
            seen.add(package)
            parser = settings_parser(cls, "")
            spelled = [arg.split("=")[0] for arg in flags if arg.startswith("--")]
            failures += [
                f"{label}: {flag} is not a flag of {package} (abbreviations do not count)"
                for flag in spelled
                if flag not in parser._option_string_actions
            ]
            try:
                parser.parse_args(flags)
            except SystemExit:
                failures.append(f"{label}: {package} does not accept the flags {flags}")
            fields = {env_name(field.name) for field in dataclasses.fields(cls)}
            failures += [
                f"{label}: {name} is not a setting of {cls.__name__} ({', '.join(sorted(fields))})"
                for name in specdec_vars
                if name not in fields
            ]
            known = {name: value for name, value in env.items() if value is not None and name in fields}
            try:
                parse_settings(cls, flags, environ=known)
            except (ValueError, TypeError, SystemExit) as error:
                failures.append(f"{label}: {cls.__name__} rejects the values: {error!r}")
    assert not failures, "\n".join(failures)
    assert seen == set(SETTINGS), f"{overlay} runs {sorted(seen)}, not every service"


def test_coordinator_replica_entries_name_headless_services_of_the_right_pods(overlay):
    objects = render(overlay)
    serving_ports = {}  # pod labels -> the gRPC port that pod serves, per service package
    for _, template, _, _, settings in services(objects):
        serving_ports[type(settings).__name__, tuple(sorted(template["metadata"]["labels"].items()))] = port_of(
            settings.address
        )
    failures = []
    for where, _, _, _, settings in services(objects):
        if not isinstance(settings, CoordinatorSettings):
            continue
        for kind, entries in (("DraftSettings", settings.draft_replicas), ("VerifySettings", settings.verify_replicas)):
            for entry in entries:
                assert entry.startswith("dns:///"), f"{where}: {entry} is one fixed address; use dns:///SERVICE:PORT"
                host, _, port = entry.removeprefix("dns:///").rpartition(":")
                service = named(objects, "Service", host.split(".")[0])
                if service is None or service["spec"].get("clusterIP") != "None":
                    failures.append(f"{where}: {entry} needs a headless Service {host.split('.')[0]}")
                    continue
                if int(port) not in [p["port"] for p in service["spec"]["ports"]]:
                    failures.append(f"{where}: Service {host} has no port {port}")
                selector = service["spec"]["selector"].items()
                targets = [
                    p for (k, labels), p in serving_ports.items() if k == kind and selector <= dict(labels).items()
                ]
                if targets != [int(port)] * len(targets) or not targets:
                    failures.append(f"{where}: {entry} reaches {kind} pods serving on {targets or 'nothing'}")
    assert not failures, "\n".join(failures)


def test_pods_are_hardened_probed_and_sized(overlay):
    failures = []
    for where, template, _ in all_pods(render(overlay)):
        spec = template["spec"]
        volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
        for container in spec["containers"]:
            label = f"{where} container {container['name']}"
            security = container.get("securityContext", {})
            if not (security.get("runAsNonRoot") or spec.get("securityContext", {}).get("runAsNonRoot")):
                failures.append(f"{label}: not runAsNonRoot")
            if (
                security.get("readOnlyRootFilesystem") is not True
                or security.get("allowPrivilegeEscalation") is not False
            ):
                failures.append(f"{label}: needs readOnlyRootFilesystem and no privilege escalation")
            if "ALL" not in security.get("capabilities", {}).get("drop", []):
                failures.append(f"{label}: does not drop ALL capabilities")
            resources = container.get("resources", {})
            if any(
                kind not in resources.get(level, {}) for level in ("requests", "limits") for kind in ("cpu", "memory")
            ):
                failures.append(f"{label}: needs cpu and memory requests and limits")
            gpus = resources.get("limits", {}).get("nvidia.com/gpu")
            if gpus != resources.get("requests", {}).get("nvidia.com/gpu"):
                failures.append(f"{label}: nvidia.com/gpu requests and limits differ")
            tmp = next((m for m in container.get("volumeMounts", []) if m["mountPath"] == "/tmp"), None)
            if tmp is None or "emptyDir" not in volumes.get(tmp["name"], {}):
                failures.append(f"{label}: needs an emptyDir at /tmp (the root filesystem is read-only)")
    assert not failures, "\n".join(failures)


def test_services_have_grpc_probes_and_drain_inside_the_grace_period(overlay):
    failures = []
    for where, template, _, container, settings in services(render(overlay)):
        label = f"{where} container {container['name']}"
        port = port_of(settings.address)
        if port not in [p["containerPort"] for p in container.get("ports", [])]:
            failures.append(f"{label}: serves on {port} but does not declare that containerPort")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if container.get(probe, {}).get("grpc", {}).get("port") != port:
                failures.append(f"{label}: {probe} must be a gRPC health check on port {port}")
        startup = container.get("startupProbe", {})
        startup_s = startup.get("initialDelaySeconds", 0) + startup.get("periodSeconds", 10) * startup.get(
            "failureThreshold", 3
        )
        waits_s = settings.startup_timeout_s if isinstance(settings, CoordinatorSettings) else 120
        if startup_s < waits_s:
            failures.append(f"{label}: startupProbe allows {startup_s}s, start-up may take {waits_s:.0f}s")
        pre_stop_s = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        grace_period = template["spec"].get("terminationGracePeriodSeconds", 30)
        if grace_period <= pre_stop_s + settings.grace_s:
            failures.append(
                f"{label}: terminationGracePeriodSeconds {grace_period} <= preStop {pre_stop_s}s "
                f"+ SPECDEC_GRACE_S {settings.grace_s:.0f}s"
            )
    assert not failures, "\n".join(failures)


def test_gpu_counts_match_tensor_parallel_size_and_pools_differ(overlay):
    objects = render(overlay)
    failures, pools = [], {}
    for where, template, owner, container, settings in services(objects):
        kind = type(settings).__name__
        pools[kind] = template["spec"].get("nodeSelector")
        if not isinstance(settings, VerifySettings):
            continue
        gpus = int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
        if owner["kind"] == "RayCluster":  # rank 0 is this container; the others are actors on the Ray nodes
            gpus = sum(
                replicas * int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
                for replicas, t in [
                    (1, owner["spec"]["headGroupSpec"]["template"]),
                    *((g["replicas"], g["template"]) for g in owner["spec"]["workerGroupSpecs"]),
                ]
                for c in t["spec"]["containers"]
            )
        if gpus and gpus != settings.tensor_parallel_size:
            failures.append(f"{where}: {gpus} GPUs for a tensor-parallel size of {settings.tensor_parallel_size}")
    on_gpus = any(
        "nvidia.com/gpu" in c["resources"]["limits"] for _, t, _ in all_pods(objects) for c in t["spec"]["containers"]
    )
    if on_gpus and (not pools.get("DraftSettings") or pools.get("DraftSettings") == pools.get("VerifySettings")):
        failures.append(f"the draft and verify GPUs must come from different node pools: {pools}")
    assert not failures, "\n".join(failures)


def test_only_the_coordinator_is_reachable_from_outside(overlay):
    objects = render(overlay)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert any(
        p["spec"]["podSelector"] == {} and "Ingress" in p["spec"]["policyTypes"] and not p["spec"].get("ingress")
        for p in policies
    ), "no default-deny ingress NetworkPolicy"
    failures = []
    for policy in policies:
        selected = policy["spec"]["podSelector"].get("matchLabels", {})
        for rule in policy["spec"].get("ingress", []):
            sources = rule.get("from", [])
            opens_to_all = not sources or any(set(s) - {"podSelector"} for s in sources)
            if opens_to_all and selected.get("app.kubernetes.io/component") != "coordinator":
                failures.append(
                    f"NetworkPolicy/{policy['metadata']['name']} admits traffic from outside the "
                    f"namespace to {selected or 'every pod'}"
                )
    assert not failures, "\n".join(failures)
