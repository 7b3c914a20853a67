"""The Kubernetes manifests: every overlay renders (alone, and the GPU ones with the optional monitoring
component), every object passes strict schema validation, every container's command, flags and SPECDEC_*
variables are ones the services' real entry points accept, and the wiring holds together: Secret and
ConfigMap keys, plaintext health probes, TLS and API keys, the NetworkPolicies' flows, metrics and
autoscaling, storage, disruption budgets and QoS. So the manifests cannot drift from the code."""

from __future__ import annotations

import dataclasses
import importlib.util

import kubernetes_validate
import pytest
import yaml
from crd_schema import validation_errors, vendored_crds
from rendered import (
    IMAGE_WORKDIR,
    K8S_DIR,
    MONITORING,
    NAMESPACE,
    OVERLAYS,
    ROOT,
    SETTINGS,
    TOOLS,
    all_pods,
    container_env,
    k8s_secrets,
    named,
    pod_templates,
    port_of,
    render,
    selects,
    service_of,
    services,
    with_secrets,
)

from coordinator.settings import CoordinatorSettings
from draft_service.settings import DraftSettings
from specdec.common.settings import env_name, parse_settings, settings_parser
from specdec.serving.health_status import LIVENESS
from specdec.telemetry.metrics import PREFIX
from verify_service.settings import VerifySettings

# 1.30 is the oldest release the manifests target (preStop `sleep` on by default); the newest is current.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())


def test_the_issue_overlays_exist():
    assert {"cpu-demo", "gpu"} <= set(OVERLAYS), OVERLAYS


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_passes_strict_validation(overlay, version):
    """Built-in kinds with kubernetes-validate; custom resources against their operators' vendored CRDs
    (tests/k8s/schemas), a RayCluster's pod templates also as Pods. The CRD is that of the oldest KubeRay
    k8s/README.md names (tests/k8s/test_operators.py checks they agree): before, it named v1.1 and v1.5, whose
    CRDs refuse the RayCluster (v1.5.2's its spec.upgradeStrategy, v1.1.0's that and lifecycle.preStop.sleep)."""
    failures = []
    for obj in render(overlay):
        if obj["kind"] == "PodMonitor":
            continue  # test_metrics_are_declared_scraped_and_drive_the_draft_autoscaler checks it
        if obj["kind"] in vendored_crds():
            _, crd = vendored_crds()[obj["kind"]]
            failures += [f"{obj['kind']}/{obj['metadata']['name']}: {error}" for error in validation_errors(crd, obj)]
        if obj["kind"] in ("Certificate", "Issuer"):
            continue
        # kubernetes-validate knows no custom resources: the pods a RayCluster makes are validated as Pods.
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
            if container["name"] in TOOLS:
                failures += check_tool(label, container, specdec_vars)
                continue
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


def check_tool(label: str, container: dict, specdec_vars: list[str]) -> list[str]:
    """A tool container runs its command from the image, and reads only settings it knows."""
    runs, needs, reads = TOOLS[container["name"]]
    failures = []
    if runs not in " ".join([*container.get("command", []), *container.get("args", [])]):
        failures.append(f"{label}: does not run `{runs}`")
    if needs is None:  # a command of the image's system (chown)
        pass
    elif needs.endswith(".py"):
        ignored = (ROOT / ".dockerignore").read_text().split()
        if not (ROOT / needs).is_file() or needs.split("/")[0] in ignored or f"{IMAGE_WORKDIR}/{needs}" not in runs:
            failures.append(f"{label}: {needs} is not in the image at {IMAGE_WORKDIR}")
    elif importlib.util.find_spec(needs) is None:
        failures.append(f"{label}: no module {needs}")
    coordinator_fields = {env_name(field.name) for field in dataclasses.fields(CoordinatorSettings)}
    failures += [
        f"{label}: {name} is not read by {needs} (or not a coordinator setting)"
        for name in specdec_vars
        if name not in reads or name not in coordinator_fields
    ]
    return failures


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


def test_probes_check_plaintext_health_ports_and_services_drain_inside_the_grace_period(overlay):
    """Kubelet's gRPC probes speak plaintext only: each service has a health-only port (SPECDEC_HEALTH_PORT,
    specdec/serving/server.py) apart from its TLS port, declares it, and every probe checks it."""
    failures = []
    for where, template, _, container, settings in services(render(overlay)):
        label = f"{where} container {container['name']}"
        port, health = port_of(settings.address), settings.health_port
        declared = {p["containerPort"]: p.get("name") for p in container.get("ports", [])}
        if port not in declared:
            failures.append(f"{label}: serves on {port} but does not declare that containerPort")
        if not health or health == port or declared.get(health) != "health":
            failures.append(f"{label}: needs a plaintext health port apart from {port}, declared as `health`")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if container.get(probe, {}).get("grpc", {}).get("port") != health:
                failures.append(f"{label}: {probe} must be a gRPC health check on the health port {health}")
        startup = container.get("startupProbe", {})
        startup_s = startup.get("initialDelaySeconds", 0) + startup.get("periodSeconds", 10) * startup.get(
            "failureThreshold", 3
        )
        if isinstance(settings, CoordinatorSettings):
            waits_s = settings.startup_timeout_s
        elif isinstance(settings, VerifySettings) and settings.tensor_parallel_size > 1:
            waits_s = settings.tp_start_timeout_s + 120  # the ranks' start, then rank 0's own set-up
        else:
            waits_s = 120
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


# The grpc.health.v1 name each probe must check (specdec/serving/health_status.py).
PROBED_NAMES = {"startupProbe": "", "readinessProbe": "", "livenessProbe": LIVENESS}


def test_liveness_probes_check_the_process_and_readiness_probes_its_dependencies(overlay):
    """Liveness reads the process-only name `liveness`, readiness and startup the overall name "", which follows
    dependencies. Caught on the manifests before this: every probe read "", so a verify outage longer than the
    liveness window (a RayCluster restart takes up to 30 minutes) restarted every coordinator."""
    failures = []
    for where, _, _, container, _ in services(render(overlay)):
        for probe, name in PROBED_NAMES.items():
            checked = container.get(probe, {}).get("grpc", {}).get("service", "")
            if checked != name:
                failures.append(f"{where} container {container['name']}: {probe} checks {checked!r}, not {name!r}")
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


def test_no_secret_is_shipped(overlay):
    """Applying must never overwrite the real Secrets (scripts/k8s_secrets.py makes them)."""
    assert not [o["metadata"]["name"] for o in render(overlay) if o["kind"] == "Secret"]


SOURCES = (("ConfigMap", "configMap", "name"), ("Secret", "secret", "secretName"))  # kind, volume field, name field


def volume_sources(volume: dict) -> list[tuple[str, dict, str]]:
    """(kind, source, name) for each ConfigMap or Secret a volume holds (a projected volume: several)."""
    if "projected" in volume:  # its sources name their object `name`, Secrets too
        sources = volume["projected"].get("sources", [])
        return [
            (kind, source[field], source[field]["name"])
            for source in sources
            for kind, field, _ in SOURCES
            if field in source
        ]
    return [(kind, volume[field], volume[field][name_field]) for kind, field, name_field in SOURCES if field in volume]


def references(template: dict) -> list[tuple[str, str, str | None, bool]]:
    """(kind, name, key or None for all of them, optional) for each ConfigMap or Secret a pod reads."""
    found = []
    spec = template["spec"]
    for container in spec.get("initContainers", []) + spec["containers"]:
        for source in container.get("envFrom", []):
            for kind, field in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if field in source:
                    found.append((kind, source[field]["name"], None, bool(source[field].get("optional"))))
        for var in container.get("env", []):
            for kind, field in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                ref = var.get("valueFrom", {}).get(field)
                if ref:
                    found.append((kind, ref["name"], ref["key"], bool(ref.get("optional"))))
    for volume in spec.get("volumes", []):
        for kind, source, name in volume_sources(volume):
            keys = [item["key"] for item in source.get("items", [])] or [None]
            found += [(kind, name, key, bool(source.get("optional"))) for key in keys]
    return found


def mounted_files(template: dict, container: dict, keys_of: dict) -> tuple[set[str], set[str]]:
    """(the mount paths of ConfigMap and Secret volumes, each file the container sees in them); a source of any
    keys (specdec-api-keys) counts as its mount path."""
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    roots, files = set(), set()
    for mount in container.get("volumeMounts", []):
        for kind, source, name in volume_sources(volumes.get(mount["name"], {})):
            roots.add(mount["mountPath"])
            keys, any_keys = keys_of.get((kind, name), (set(), True))
            paths = [item["path"] for item in source.get("items", [])] or ([""] if any_keys else sorted(keys))
            files |= {f"{mount['mountPath']}/{path}".rstrip("/") for path in paths}
    return roots, files


def test_every_configmap_and_secret_key_read_exists_and_every_one_shipped_is_read(overlay):
    objects = with_secrets(render(overlay))
    keys_of = {
        (o["kind"], o["metadata"]["name"]): (set(o.get("data", {})) | set(o.get("stringData", {})), o.get("anyKeys"))
        for o in objects
        if o["kind"] in ("ConfigMap", "Secret")
    }
    failures, read = [], {kind_name: set() for kind_name in keys_of}
    for where, template, _ in all_pods(objects):
        for kind, name, key, optional in references(template):
            if (kind, name) not in keys_of:
                if not optional:
                    failures.append(f"{where}: reads {kind} {name}, which neither the render nor k8s_secrets has")
                continue
            keys, any_keys = keys_of[kind, name]
            if key is not None and key not in keys and not any_keys:
                failures.append(f"{where}: reads key {key} of {kind} {name}, which has {sorted(keys)}")
            read[kind, name] |= keys if key is None else {key}
            read[kind, name].add(None)  # read at all
        # A setting that names a path in a mounted ConfigMap or Secret names one of its files, or a directory of them.
        for container in template["spec"]["containers"]:
            env, _ = container_env(objects, container)
            roots, files = mounted_files(template, container, keys_of)
            for var, value in env.items():
                if not value or not any(value.startswith(root + "/") for root in roots):
                    continue
                if value not in files and not any(path.startswith(value + "/") for path in files):
                    failures.append(
                        f"{where}: {var}={value} is no file (or directory) of a mounted ConfigMap or Secret"
                    )
    for (kind, name), (keys, _) in keys_of.items():
        unread = sorted(keys - read[kind, name]) if None in read[kind, name] else ["(the whole object)"]
        failures += [f"{kind} {name}: key {key} is shipped but no pod reads it" for key in unread]
    assert not failures, "\n".join(failures)


def test_tls_everywhere_api_keys_required_and_redis_from_its_secret(overlay):
    objects = render(overlay)
    failures, prefixes = [], set()
    for where, _, _, container, settings in services(objects):
        label = f"{where} container {container['name']}"
        if not (settings.tls_cert and settings.tls_key):
            failures.append(f"{label}: serves without TLS")
        env = {var["name"]: var.get("valueFrom", {}) for var in container.get("env", [])}
        if isinstance(settings, CoordinatorSettings):
            if settings.tls_client_ca:
                failures.append(f"{label}: clients authenticate with API keys, not certificates")
            if not (settings.replica_tls_ca and settings.replica_tls_cert and settings.replica_tls_key):
                failures.append(f"{label}: must speak mutual TLS to the replicas")
            if settings.replica_tls_server_name not in k8s_secrets.dns_names(NAMESPACE, "cluster.local"):
                failures.append(f"{label}: checks replicas against a name the certificate lacks")
            if not settings.require_api_key:
                failures.append(f"{label}: does not require API keys")
            if env.get("SPECDEC_REDIS_URL", {}).get("secretKeyRef") != {"name": "specdec-redis", "key": "url"}:
                failures.append(f"{label}: SPECDEC_REDIS_URL must come from Secret specdec-redis, key url")
            prefixes.add(settings.redis_key_prefix)
        elif not settings.tls_client_ca:
            failures.append(f"{label}: must require client certificates (mutual TLS)")
    seeders = [
        (where, c) for where, t, _ in all_pods(objects) for c in t["spec"]["containers"] if c["name"] == "seed-api-keys"
    ]
    if len(seeders) != 1:
        failures.append(f"one API-key seeding container expected, found {len(seeders)}")
    for where, container in seeders:
        env, _ = container_env(objects, container)
        url = next(v for v in container["env"] if v["name"] == "SPECDEC_REDIS_URL")
        if url.get("valueFrom", {}).get("secretKeyRef") != {"name": "specdec-redis", "key": "url"}:
            failures.append(f"{where}: SPECDEC_REDIS_URL must come from Secret specdec-redis, key url")
        prefix = env.get("SPECDEC_REDIS_KEY_PREFIX") or CoordinatorSettings().redis_key_prefix
        if prefixes != {prefix}:
            failures.append(f"{where}: seeds keys under {prefix!r}, the coordinators read {sorted(prefixes)}")
    assert not failures, "\n".join(failures)


def admitted(policies, source: dict, target: dict, port: int) -> bool:
    """Whether the NetworkPolicies let `source` ({namespace, labels}) reach `target` (a pod template in the
    namespace) on TCP `port`."""
    container_ports = {
        p.get("name"): p["containerPort"] for c in target["spec"]["containers"] for p in c.get("ports", [])
    }
    isolating = [
        p
        for p in policies
        if "Ingress" in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], target["metadata"]["labels"])
    ]
    if not isolating:
        return True
    namespace_labels = {"kubernetes.io/metadata.name": source["namespace"]}
    for policy in isolating:
        for rule in policy["spec"].get("ingress", []):
            ports = [container_ports.get(p["port"], p["port"]) for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            for peer in rule.get("from", [{}]):
                assert "ipBlock" not in peer, f"{policy['metadata']['name']}: ipBlock peers are not modelled here"
                in_namespace = (
                    selects(peer["namespaceSelector"], namespace_labels)
                    if "namespaceSelector" in peer
                    else source["namespace"] == NAMESPACE or not peer
                )
                if in_namespace and selects(peer.get("podSelector", {}), source["labels"]):
                    return True
    return False


def role(labels: dict) -> str:
    return labels.get("app.kubernetes.io/component", "?")


# Who must reach what, by component (or namespace) and container port; nothing else may.
FLOWS = {
    ("anyone", "coordinator", 50051),
    ("anyone", "coordinator", 8000),
    ("coordinator", "draft", 50061),
    ("coordinator", "verify", 50062),
    ("coordinator", "redis", 6379),
    ("api-keys-seed", "redis", 6379),
    *(("monitoring", service, 9090) for service in ("coordinator", "draft", "verify")),
}


def expected_flow(source: dict, target: dict, port: int) -> bool:
    if {"ray.io/cluster"} <= source["labels"].keys() & target["metadata"]["labels"].keys():
        return True  # the Ray head and rank pods of one cluster talk on many ports (GCS, raylets, NCCL)
    name = source["namespace"] if source["namespace"] != NAMESPACE else role(source["labels"])
    return ("anyone", role(target["metadata"]["labels"]), port) in FLOWS or (
        name,
        role(target["metadata"]["labels"]),
        port,
    ) in FLOWS


def test_network_policies_admit_the_flows_the_services_make_and_no_others(overlay):
    objects = render(overlay)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert any(p["spec"]["podSelector"] == {} and not p["spec"].get("ingress") for p in policies), "no default deny"
    pods = [(where, template) for where, template, _ in all_pods(objects)]
    sources = [
        *({"namespace": NAMESPACE, "labels": template["metadata"]["labels"]} for _, template in pods),
        {"namespace": "monitoring", "labels": {"app.kubernetes.io/name": "prometheus"}},
        {"namespace": "apps", "labels": {"app": "client"}},
    ]
    failures, seen = [], set()
    for where, target in pods:
        for port in {p["containerPort"] for c in target["spec"]["containers"] for p in c.get("ports", [])}:
            for source in sources:
                allowed, expected = admitted(policies, source, target, port), expected_flow(source, target, port)
                who = f"{source['namespace']}/{role(source['labels'])}"
                if allowed != expected:
                    failures.append(f"{who} -> {where}:{port} is {'admitted' if allowed else 'refused'}")
                if allowed:
                    seen.add(
                        (
                            source["namespace"] if source["namespace"] != NAMESPACE else role(source["labels"]),
                            role(target["metadata"]["labels"]),
                            port,
                        )
                    )
    missing = {flow for flow in FLOWS if flow[0] != "anyone"} - seen
    failures += [f"no pods for the flow {flow}" for flow in sorted(missing)]
    assert not failures, "\n".join(failures)


def workload_replicas(objects, obj: dict) -> int:
    """A workload's replicas: its HPA's minimum when one owns it."""
    hpa = next(
        (
            o
            for o in objects
            if o["kind"] == "HorizontalPodAutoscaler" and o["spec"]["scaleTargetRef"]["name"] == obj["metadata"]["name"]
        ),
        None,
    )
    return hpa["spec"]["minReplicas"] if hpa else obj["spec"].get("replicas", 1)


# Controllers with a scale subresource: a budget over their pods may use maxUnavailable or percentages. For any
# other owner (a RayCluster has none) the disruption controller cannot count the pods it expects and the budget
# stays SyncFailed, blocking every eviction: only an integer minAvailable works there.
SCALABLE_OWNERS = ("Deployment", "StatefulSet", "ReplicaSet", "ReplicationController")


def test_disruption_budgets_protect_a_pod_and_let_one_go(overlay):
    """Each budget of a Deployment or StatefulSet keeps one pod serving and lets a drain take one; a
    RayCluster's (one TP group) allows none, on purpose: a group missing a rank cannot serve. It says so with an
    integer minAvailable, its pod count, and lets a pod that is not ready go. Caught on the manifests before
    this: `maxUnavailable: 0` over the RayCluster's pods, which leaves the budget SyncFailed."""
    objects = render(overlay)
    failures = []
    for pdb in (o for o in objects if o["kind"] == "PodDisruptionBudget"):
        owners = [
            (where, owner)
            for where, t, owner in all_pods(objects)
            if selects(pdb["spec"]["selector"], t["metadata"]["labels"])
        ]
        if not owners:
            failures.append(f"PodDisruptionBudget/{pdb['metadata']['name']} selects no pods")
        for where, owner in owners:
            if owner["kind"] not in SCALABLE_OWNERS:
                minimum = pdb["spec"].get("minAvailable")
                if "maxUnavailable" in pdb["spec"] or not isinstance(minimum, int):
                    failures.append(f"{where}: a {owner['kind']} has no scale subresource: use an integer minAvailable")
                pods = 1 + sum(group["replicas"] for group in owner["spec"].get("workerGroupSpecs", []))
                if minimum != pods:
                    failures.append(
                        f"{where}: a TP group must not lose a rank to a drain: minAvailable {minimum} != {pods}"
                    )
                if pdb["spec"].get("unhealthyPodEvictionPolicy") != "AlwaysAllow":
                    failures.append(f"{where}: a broken group's pods (not ready) must stay evictable")
                continue
            replicas = workload_replicas(objects, owner)
            allowed = pdb["spec"].get("maxUnavailable", replicas - pdb["spec"].get("minAvailable", 0))
            if not 1 <= allowed < replicas:
                failures.append(f"{where}: {replicas} replicas, a budget allowing {allowed} down protects nothing")
    assert not failures, "\n".join(failures)


def test_gpu_pods_are_guaranteed_qos(overlay):
    failures = []
    for where, template, _ in all_pods(render(overlay)):
        spec = template["spec"]
        containers = spec.get("initContainers", []) + spec["containers"]
        if not any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {}) for c in containers):
            continue
        for container in containers:
            resources = container.get("resources", {})
            for kind in ("cpu", "memory"):
                if resources.get("requests", {}).get(kind) != resources.get("limits", {}).get(kind):
                    failures.append(f"{where} container {container['name']}: {kind} requests != limits")
    assert not failures, "\n".join(failures)


def test_model_volume_binds_and_is_filled_by_a_job(overlay):
    """Claims name a storage class (none binds where the cluster has no default), the models volume is
    shared read-write for the fetch Job and read-only for every pod that serves from it."""
    objects = render(overlay)
    claims = [
        (f"PersistentVolumeClaim/{o['metadata']['name']}", o["spec"])
        for o in objects
        if o["kind"] == "PersistentVolumeClaim"
    ]
    claims += [
        (f"StatefulSet/{o['metadata']['name']} claim {c['metadata']['name']}", c["spec"])
        for o in objects
        if o["kind"] == "StatefulSet"
        for c in o["spec"].get("volumeClaimTemplates", [])
    ]
    failures = []
    if not overlay.startswith("gpu"):  # cpu-demo: the models are in the image; the laptop's default class
        assert not any(name.startswith("PersistentVolumeClaim/specdec-models") for name, _ in claims)
        return
    failures += [f"{name}: no storageClassName" for name, spec in claims if not spec.get("storageClassName")]
    models = named(objects, "PersistentVolumeClaim", "specdec-models")
    assert models is not None and "ReadWriteMany" in models["spec"]["accessModes"], "specdec-models must be RWX"
    writers = []
    for where, template, _ in all_pods(objects):
        volumes = [
            v["name"]
            for v in template["spec"].get("volumes", [])
            if v.get("persistentVolumeClaim", {}).get("claimName") == "specdec-models"
        ]
        for container in template["spec"]["containers"]:
            for mount in (m for m in container.get("volumeMounts", []) if m["name"] in volumes):
                if not mount.get("readOnly"):
                    writers.append(f"{where} container {container['name']}")
    if writers != ["Job/specdec-models-fetch container fetch-models"]:
        failures.append(f"only the fetch Job may write the models volume, writers: {writers}")
    fetch = named(
        objects,
        "ConfigMap",
        next(o["metadata"]["name"] for o in objects if o["metadata"]["name"].startswith("specdec-models-")),
    )
    if not {"TARGET_MODEL_URI", "DRAFT_MODEL_URI"} <= set(fetch["data"]):
        failures.append("the models ConfigMap needs TARGET_MODEL_URI and DRAFT_MODEL_URI")
    assert not failures, "\n".join(failures)


def test_metrics_are_declared_scraped_and_drive_the_draft_autoscaler(overlay):
    """Every service serves /metrics on a declared port named `metrics`, annotated for annotation-based
    scraping; with the monitoring component a PodMonitor scrapes that port and the draft HPA scales on
    specdec_active_sessions through the prometheus-adapter rule shipped beside it (CPU as the second
    metric); without it the HPAs use CPU alone (no adapter: a Pods metric would block every scale-down)."""
    objects = render(overlay)
    failures, service_pods, max_sessions = [], [], {}
    for where, template, _, container, settings in services(objects):
        service_pods.append((where, template))
        metrics_port = settings.metrics_port
        declared = {p["containerPort"]: p.get("name") for p in container.get("ports", [])}
        annotations = template["metadata"].get("annotations", {})
        if not metrics_port or declared.get(metrics_port) != "metrics":
            failures.append(f"{where}: SPECDEC_METRICS_PORT {metrics_port} is not a declared port named metrics")
        if (
            annotations.get("prometheus.io/port") != str(metrics_port)
            or annotations.get("prometheus.io/scrape") != "true"
        ):
            failures.append(f"{where}: prometheus.io annotations do not point at port {metrics_port}")
        if isinstance(settings, DraftSettings):
            max_sessions[where] = settings.max_sessions
    hpa = named(objects, "HorizontalPodAutoscaler", "specdec-draft")
    kinds = {m["type"]: m for m in hpa["spec"]["metrics"]}
    monitors = [o for o in objects if o["kind"] == "PodMonitor"]
    if not overlay.endswith(MONITORING):
        assert not monitors and set(kinds) == {"Resource"}, f"{overlay}: custom metrics need the component"
        assert not failures, "\n".join(failures)
        return
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
        scraped = [(w, t) for w, t in service_pods if selects(monitor["spec"]["selector"], t["metadata"]["labels"])]
        if len(scraped) != len(service_pods):
            failures.append(f"PodMonitor/{monitor['metadata']['name']} misses service pods")
        for where, template in scraped:
            names = {p.get("name") for c in template["spec"]["containers"] for p in c.get("ports", [])}
            failures += [f"PodMonitor: {where} has no port named {port}" for port in ports - names]
    adapter = yaml.safe_load((K8S_DIR / "components" / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    rule = adapter["rules"]["custom"][0]
    metric = kinds.get("Pods", {}).get("pods", {})
    if metric.get("metric", {}).get("name") != rule["name"]["as"] or "Resource" not in kinds:
        failures.append(f"draft HPA must scale on {rule['name']['as']} (Pods) and CPU (Resource): {list(kinds)}")
    series = rule["seriesQuery"].split("{")[0]
    if f'PREFIX + "{series.removeprefix(PREFIX)}"' not in (ROOT / "specdec" / "telemetry" / "metrics.py").read_text():
        failures.append(f"the adapter reads {series}, which specdec/telemetry/metrics.py does not export")
    target = float(metric.get("target", {}).get("averageValue", "inf"))
    failures += [
        f"{where}: HPA target {target} sessions >= max_sessions {n}" for where, n in max_sessions.items() if target >= n
    ]
    assert not failures, "\n".join(failures)
