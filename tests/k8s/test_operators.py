"""The manifests where they meet what runs them: the operators (KubeRay, cert-manager), the Deployment and Job
controllers, GitOps tools, node pools and their autoscalers, the shell KubeRay's start command runs in. Each test
says in its docstring what it caught on the manifests before it (run against main's k8s/ once)."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import stat
import subprocess
import tempfile

import pytest
import yaml
from crd_schema import vendored_crds
from rendered import (
    IMAGE,
    K8S_DIR,
    NAMESPACE,
    OVERLAYS,
    ROOT,
    VARIANTS,
    all_pods,
    k8s_secrets,
    named,
    render,
    render_on_top,
    services,
)

from coordinator.settings import CoordinatorSettings
from verify_service.settings import VerifySettings

README = K8S_DIR / "README.md"
IMAGE_PULL_ALLOWANCE_S = 300  # scheduling and pulling an image, before the startup probe's window starts
POOL_LABEL = "specdec/gpu-pool"


def ray_clusters(objects) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == "RayCluster"]


def is_specdec_image(image: str) -> bool:
    return image.split("@")[0].split(":")[0].rsplit("/", 1)[-1] == IMAGE


# --- KubeRay -------------------------------------------------------------------------------------------------


def test_the_minimum_kuberay_is_stated_once_and_is_the_one_whose_crd_the_tests_use():
    """k8s/README.md names the oldest KubeRay once, and it is the release of the vendored CRD every RayCluster is
    validated against; no other operator version appears in k8s/ but the vendored ones. Caught before: the
    kustomization said v1.1, the README v1.1+ and v1.5, while spec.upgradeStrategy needs v1.6.0."""
    version, _ = vendored_crds()["RayCluster"]
    stated = re.findall(r"KubeRay (?:operator )?(v\d+\.\d+\.\d+) or newer", README.read_text())
    assert stated == [version], f"k8s/README.md states {stated}, the vendored CRD is {version}"
    vendored = {v.rsplit(".", 1)[0] for v, _ in vendored_crds().values()}
    for path in sorted(p for p in K8S_DIR.rglob("*") if p.is_file()):
        for found in re.findall(r"\bv(\d+\.\d+)(?:\.\d+)?\b", path.read_text()):
            assert f"v{found}" in vendored, f"{path.relative_to(ROOT)} names v{found}; the tests know {vendored}"


def test_ray_version_is_the_ray_the_image_installs():
    """rayVersion equals requirements.txt's ray pin (the image installs it) and the ray these tests run. Caught
    before: requirements.txt left ray unpinned against rayVersion 2.60.0."""
    import ray

    pins = re.findall(r"^ray==(\S+)", (ROOT / "requirements.txt").read_text(), re.MULTILINE)
    assert pins == [ray.__version__], f"requirements.txt pins ray {pins}, installed {ray.__version__}"
    for variant in VARIANTS:
        for cluster in ray_clusters(render(variant)):
            assert cluster["spec"]["rayVersion"] == pins[0], f"{variant}: rayVersion {cluster['spec']['rayVersion']}"


def verify_settings_of(objects, cluster: dict) -> VerifySettings:
    head = f"RayCluster/{cluster['metadata']['name']} head"
    return next(settings for where, *_, settings in services(objects) if where == head)


def test_bundle_zero_asks_for_a_resource_that_only_the_head_offers(overlay):
    """The verify process (rank 0) runs in the head; the Ray resource its launcher's bundle 0 asks for
    (tp_ray_rank0_resource) is offered by the head group and no worker group, so the GPU bundle 0 reserves is
    the head's (tests/verify_service/test_ray_rank0_placement.py shows it on a Ray cluster). Caught before: no
    such resource anywhere; PACK could put bundle 0 on the worker pod."""
    objects = render(overlay)
    for cluster in ray_clusters(objects):
        resource = verify_settings_of(objects, cluster).tp_ray_rank0_resource
        assert resource, "the verify service must pin bundle 0"
        assert cluster["spec"]["headGroupSpec"].get("resources", {}).get(resource) == "1"
        assert "resources" not in cluster["spec"]["headGroupSpec"].get("rayStartParams", {})  # would be overridden
        for group in cluster["spec"]["workerGroupSpecs"]:
            assert resource not in group.get("resources", {}), group["groupName"]


def kuberay_start_command(group: dict, head: bool) -> str:
    """`ray start` as KubeRay v1.6 writes it into $KUBERAY_GEN_RAY_START_CMD (ray-operator/controllers/ray/common/
    pod.go: generateRayStartCommand, convertParamMap, updateRayStartParamsResources): sorted ` --key=value `
    flags, `true` flags bare, the group's custom resources as a single-quoted JSON."""
    params = {**group.get("rayStartParams", {}), "block": "true"}
    resources = {name: float(quantity) for name, quantity in group.get("resources", {}).items()}
    resources["specdec_quoting_probe"] = 1.0  # every group gets one quoted value, as a head with resources does
    params["resources"] = "'" + ",".join(f'"{n}":{v:g}' for n, v in sorted(resources.items())).join("{}") + "'"
    flags = "".join(
        f" --{key} "
        if value.lower() == "true" and key not in ("log-color", "include-dashboard")
        else f" --{key}={value} "
        for key, value in sorted(params.items())
        if value.lower() != "false" or key in ("log-color", "include-dashboard")
    )
    return f"ray start {'--head ' if head else ''}{flags}"


def shim(directory: pathlib.Path, name: str, log: pathlib.Path) -> None:
    """A stand-in for a command on PATH that records its arguments, one per line, in a file of its own under `log`
    (the head's `ray start` runs beside its `ray health-check`: one shared file could interleave them)."""
    path = directory / name
    path.write_text(f'#!/bin/bash\nprintf "%s\\n" "{name}" "$@" > "$(mktemp -p {log})"\nexit 0\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def calls(log: pathlib.Path) -> list[list[str]]:
    return [path.read_text().strip("\n").split("\n") for path in sorted(log.iterdir())]


def test_kuberays_start_command_reaches_ray_with_its_quoted_values_whole(overlay):
    """Each Ray container runs $KUBERAY_GEN_RAY_START_CMD through the shell's parser (eval), so a value KubeRay
    single-quotes (--resources='{"specdec_rank0":1}') reaches `ray start` as one argument without its quotes.
    Run in bash with `ray` and `python` stand-ins on PATH. Caught before: a bare $KUBERAY_GEN_RAY_START_CMD,
    which hands ray the quotes themselves."""
    for cluster in ray_clusters(render(overlay)):
        spec = cluster["spec"]
        groups = [(spec["headGroupSpec"], True), *((group, False) for group in spec["workerGroupSpecs"])]
        for group, head in groups:
            container = group["template"]["spec"]["containers"][0]
            generated = kuberay_start_command(group, head)
            with tempfile.TemporaryDirectory() as scratch:
                bin_dir, log = pathlib.Path(scratch), pathlib.Path(scratch) / "calls"
                log.mkdir()
                for name in ("ray", "python"):
                    shim(bin_dir, name, log)
                environ = {
                    **os.environ,
                    "PATH": f"{bin_dir}:{os.environ['PATH']}",
                    "KUBERAY_GEN_RAY_START_CMD": generated,
                }
                assert container["command"][0] == "/bin/bash" and len(container["args"]) == 1
                script = container["args"][0]  # run without -l: a login shell's profile would reset PATH
                done = subprocess.run(
                    ["/bin/bash", "-c", script], env=environ, capture_output=True, text=True, timeout=30
                )
                assert done.returncode == 0, done.stderr
                # run() returned at EOF of the pipes, which the head's background `ray start` holds too.
                starts = [call[2:] for call in calls(log) if call[:2] == ["ray", "start"]]
            wanted = shlex.split(generated)[2:]  # what a shell makes of it, after `ray start`
            assert starts == [wanted], f"{group.get('groupName', 'head')}: ray start got {starts}, not {wanted}"


# --- Rollouts, Jobs, budgets ----------------------------------------------------------------------------------


def startup_window_s(container: dict) -> int:
    probe = container.get("startupProbe", {})
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def test_rollouts_wait_out_the_start_up_window(overlay):
    """A Deployment reports a rollout failed after progressDeadlineSeconds (default 600) without progress; a pod
    may take its startup probe's whole window, plus scheduling and an image pull. Caught before: no deadline
    anywhere, while verify starts for up to 1,800 s on GPUs and the coordinator for 650 s."""
    failures = []
    for obj in (o for o in render(overlay) if o["kind"] == "Deployment"):
        containers = obj["spec"]["template"]["spec"]["containers"]
        needed = max(startup_window_s(c) for c in containers) + IMAGE_PULL_ALLOWANCE_S
        deadline = obj["spec"].get("progressDeadlineSeconds", 600)
        if deadline < needed:
            failures.append(f"Deployment/{obj['metadata']['name']}: progressDeadlineSeconds {deadline} < {needed}")
    assert not failures, "\n".join(failures)


def test_jobs_stay_after_they_finish(overlay):
    """No Job deletes itself (ttlSecondsAfterFinished): Argo CD and Flux would create it again on every sync, and
    it would run again. Caught before: both Jobs deleted themselves after 10 minutes."""
    assert not [o["metadata"]["name"] for o in render(overlay) if "ttlSecondsAfterFinished" in o.get("spec", {})]


# --- Images ---------------------------------------------------------------------------------------------------


def specdec_images(objects) -> dict[str, str]:
    return {
        f"{where} {container['name']}": container["image"]
        for where, template, _ in all_pods(objects)
        for container in template["spec"].get("initContainers", []) + template["spec"]["containers"]
        if is_specdec_image(container["image"])
    }


def test_one_image_source_sets_every_workload(tmp_path):
    """Every container of the service image in an overlay runs the same image, and it is set in one place: an
    edit of overlays/gpu's `images:` (a registry and a digest) reaches every workload of gpu and gpu-multinode,
    the RayCluster included. Caught before: gpu-multinode set the image a second time, and an edit of gpu's left
    the RayCluster on the old one."""
    for variant in VARIANTS:
        assert len(set(specdec_images(render(variant)).values())) == 1, specdec_images(render(variant))
    copy = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, copy)
    kustomization = copy / "overlays" / "gpu" / "kustomization.yaml"
    config = yaml.safe_load(kustomization.read_text())
    pinned = {"name": "specdec", "newName": "registry.example.com/team/specdec", "digest": "sha256:" + "a" * 64}
    config["images"] = [pinned if image["name"] == "specdec" else image for image in config["images"]]
    kustomization.write_text(yaml.safe_dump(config))
    for overlay in ("gpu", "gpu-multinode"):
        images = specdec_images(render(overlay, copy))
        wanted = f"{pinned['newName']}@{pinned['digest']}"
        assert set(images.values()) == {wanted}, {where: image for where, image in images.items() if image != wanted}


# --- Node pools -----------------------------------------------------------------------------------------------


def node_shapes() -> list[dict]:
    """The rows of k8s/README.md's "Node shapes" table: pool, machine, GPUs, and what is left for pods."""
    section = README.read_text().split("### Node shapes", 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        left = re.fullmatch(r"(\d+(?:\.\d+)?) CPU, (\d+) GiB", cells[-1]) if len(cells) == 7 else None
        if left:
            gpus = int(cells[3].split()[0])
            rows.append(
                {"pool": cells[0], "machine": cells[2], "gpus": gpus, "cpu": float(left[1]), "gib": int(left[2])}
            )
    assert rows, "k8s/README.md has no Node shapes table"
    return rows


def quantity(value: str) -> float:
    """CPU cores or GiB of a Kubernetes quantity."""
    units = {"m": 1e-3, "Ki": 2**-20, "Mi": 2**-10, "Gi": 1, "Ti": 2**10}
    number, unit = re.fullmatch(r"([\d.]+)([A-Za-z]*)", str(value)).groups()
    return float(number) * units.get(unit, 1)


def test_requests_fit_every_node_shape_of_their_pool(overlay):
    """A GPU pod's requests fit each node shape the README lists for its pool, after the system's share and the
    daemon sets, GPUs included. Caught before: draft pods asked 8 CPU and 32 Gi beside one GPU, which no 8-vCPU
    one-GPU node has left."""
    shapes, failures = node_shapes(), []
    for where, template, _ in all_pods(render(overlay)):
        pool = template["spec"].get("nodeSelector", {}).get(POOL_LABEL)
        if pool is None:
            continue
        requests = {}
        for container in template["spec"]["containers"]:
            for kind, value in container.get("resources", {}).get("requests", {}).items():
                requests[kind] = requests.get(kind, 0) + (int(value) if kind == "nvidia.com/gpu" else quantity(value))
        rows = [row for row in shapes if row["pool"] == pool]
        if not rows:
            failures.append(f"{where}: no node shape for pool {pool}")
        for row in rows:
            if requests.get("cpu", 0) > row["cpu"] or requests.get("memory", 0) > row["gib"]:
                failures.append(f"{where}: asks {requests}, {row['machine']} leaves {row['cpu']} CPU, {row['gib']} GiB")
            if requests.get("nvidia.com/gpu", 0) > row["gpus"]:
                failures.append(f"{where}: asks {requests['nvidia.com/gpu']} GPUs, {row['machine']} has {row['gpus']}")
    assert not failures, "\n".join(failures)


def node_pool_examples() -> list[tuple[str, str, dict, list[dict], list[str]]]:
    """(file, pool, labels, taints, machine types) of each pool in k8s/node-pools/."""
    found = []
    script = (K8S_DIR / "node-pools" / "gke.sh").read_text().replace("\\\n", " ")
    for command in re.findall(r"gcloud container node-pools create .*", script):
        labels = dict(pair.split("=") for pair in re.search(r"--node-labels (\S+)", command)[1].split(","))
        taints = []
        for taint in re.search(r"--node-taints (\S+)", command)[1].split(","):
            key, _, rest = taint.partition("=")
            value, _, effect = rest.partition(":")
            taints.append({"key": key, "value": value, "effect": effect})
        machines = [re.search(r"--machine-type (\S+)", command)[1]]
        found.append(("gke.sh", labels.get(POOL_LABEL), labels, taints, machines))
    eksctl = yaml.safe_load((K8S_DIR / "node-pools" / "eksctl.yaml").read_text())
    for group in eksctl["managedNodeGroups"]:
        found.append(
            ("eksctl.yaml", group["labels"].get(POOL_LABEL), group["labels"], group["taints"], [group["instanceType"]])
        )
    for pool in yaml.safe_load_all((K8S_DIR / "node-pools" / "karpenter.yaml").read_text()):
        template = pool["spec"]["template"]
        types = next(
            r["values"] for r in template["spec"]["requirements"] if r["key"] == "node.kubernetes.io/instance-type"
        )
        labels = template["metadata"]["labels"]
        found.append(("karpenter.yaml", labels.get(POOL_LABEL), labels, template["spec"]["taints"], types))
    return found


def tolerated(taint: dict, tolerations: list[dict]) -> bool:
    return any(
        t.get("key") == taint["key"]
        and t.get("effect", taint["effect"]) == taint["effect"]
        and (t.get("operator") == "Exists" or t.get("value") == taint["value"])
        for t in tolerations
    )


def test_node_pool_examples_label_and_taint_what_the_pods_select_and_tolerate():
    """The GKE, EKS and Karpenter examples set the label the GPU pods select and the taint they tolerate as
    node-pool configuration, for both pools, on machine types of the README's Node shapes table. Caught before:
    labels and taints applied with kubectl (lost when a node is re-created, invisible to the autoscaler)."""
    pods = [t for variant in ("gpu", "gpu-multinode") for _, t, _ in all_pods(render(variant))]
    shapes = {(row["pool"], row["machine"]) for row in node_shapes()}
    examples = node_pool_examples()
    assert {(file, pool) for file, pool, *_ in examples} == {
        (file, pool) for file in ("gke.sh", "eksctl.yaml", "karpenter.yaml") for pool in ("draft", "main")
    }
    for file, pool, labels, taints, machines in examples:
        selecting = [t for t in pods if t["spec"].get("nodeSelector", {}).get(POOL_LABEL) == pool]
        assert selecting, f"{file}: no pod selects pool {pool}"
        for template in selecting:
            assert template["spec"]["nodeSelector"].items() <= labels.items(), f"{file} {pool}: labels {labels}"
            assert all(tolerated(taint, template["spec"].get("tolerations", [])) for taint in taints), (
                f"{file} {pool}: a taint of {taints} is not tolerated"
            )
        assert all((pool, machine) in shapes for machine in machines), f"{file} {pool}: {machines} not in the table"


def test_tensor_parallel_groups_are_not_consolidated_away():
    """Pods holding a TP group (the verify Deployment on GPUs, every Ray pod) tell Karpenter and the cluster
    autoscaler not to move them: a group restarts for up to 30 minutes."""
    for variant in ("gpu", "gpu-multinode"):
        for where, template, _ in all_pods(render(variant)):
            labels = template["metadata"]["labels"]
            if labels.get("app.kubernetes.io/component") in ("verify", "verify-rank"):
                annotations = template["metadata"].get("annotations", {})
                assert annotations.get("karpenter.sh/do-not-disrupt") == "true", where
                assert annotations.get("cluster-autoscaler.kubernetes.io/safe-to-evict") == "false", where


# --- Metrics, Redis, connections ------------------------------------------------------------------------------


def metrics_namespaces(objects) -> set[str]:
    policy = named(objects, "NetworkPolicy", "specdec-metrics-from-monitoring")
    return {
        peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for rule in policy["spec"]["ingress"]
        for peer in rule["from"]
    }


@pytest.mark.parametrize("overlay_name", OVERLAYS)
def test_the_monitoring_namespace_is_a_setting(overlay_name):
    """Where Prometheus runs is a setting (base/config/monitoring.env), which an operator's own overlay sets
    with a ConfigMap merge; the metrics NetworkPolicy follows it. Caught before: `monitoring` written into the
    NetworkPolicy, changed only by editing the base."""
    assert metrics_namespaces(render(overlay_name)) == {"monitoring"}
    merge = {"name": "specdec-monitoring", "behavior": "merge", "literals": ["namespace=observability"]}
    moved = render_on_top(overlay_name, {"configMapGenerator": [merge]}, ["metrics-namespace"])
    assert metrics_namespaces(moved) == {"observability"}


def test_redis_stays_below_its_memory_limit_and_is_ready_only_when_it_answers(overlay):
    """Redis caps its memory below the container's limit, evicting only keys that expire (never API keys), and
    its startup and readiness probes want PONG (redis-cli exits 0 on LOADING and NOAUTH too). Caught before:
    no maxmemory (the kernel kills it at the limit) and no startup probe."""
    for where, template, _ in all_pods(render(overlay)):
        for container in (c for c in template["spec"]["containers"] if c["name"] == "redis"):
            env = {var["name"]: var.get("value") for var in container.get("env", [])}
            args = [env.get(a[2:-1], a) if a.startswith("$(") else a for a in container["args"]]
            maxmemory = args[args.index("--maxmemory") + 1]
            assert args[args.index("--maxmemory-policy") + 1] == "volatile-lru", where
            limit_gib = quantity(container["resources"]["limits"]["memory"])
            megabytes = float(re.fullmatch(r"(\d+)mb", maxmemory)[1])
            assert megabytes * 1e6 <= 0.75 * limit_gib * 2**30, f"{where}: maxmemory {maxmemory}, limit {limit_gib} GiB"
            for probe in ("startupProbe", "readinessProbe"):
                assert "PONG" in " ".join(container[probe]["exec"]["command"]), f"{where}: {probe}"


def test_coordinators_close_old_client_connections(overlay):
    """Clients keep one HTTP/2 connection; the coordinator closes each after a while (grpc.max_connection_age_ms)
    so clients re-resolve and reach replicas the autoscaler added. Caught before: connections lived forever."""
    for where, *_, settings in services(render(overlay)):
        if isinstance(settings, CoordinatorSettings):
            assert 0 < settings.max_connection_age_s <= settings.max_connection_age_grace_s, where


# --- Optional components ----------------------------------------------------------------------------------------


def test_cert_manager_makes_the_secrets_the_pods_read_one_key_pair_per_role():
    """components/cert-manager issues specdec-tls (server role) and specdec-tls-client (client role) with keys
    of their own and the usages of their role, the server one for every name the script's certificate has,
    from an Issuer in the render whose CA is a Certificate there too; the CRDs accept them (strict validation
    test). Caught before: no cert-manager option; one key pair for every role."""
    objects = render("gpu+cert-manager")
    certificates = {c["spec"]["secretName"]: c["spec"] for c in objects if c["kind"] == "Certificate"}
    issuers = {i["metadata"]["name"]: i["spec"] for i in objects if i["kind"] == "Issuer"}
    server, client = certificates["specdec-tls"], certificates["specdec-tls-client"]
    assert "server auth" in server["usages"] and "client auth" not in server["usages"]
    assert "client auth" in client["usages"] and "server auth" not in client["usages"]
    assert server["dnsNames"] == k8s_secrets.dns_names(NAMESPACE, "cluster.local")
    for spec in (server, client):
        assert spec["privateKey"]["rotationPolicy"] == "Always"  # a renewal makes a new key
        assert spec["issuerRef"]["kind"] == "Issuer" and spec["issuerRef"]["name"] in issuers
        ca_secret = issuers[spec["issuerRef"]["name"]]["ca"]["secretName"]
        assert certificates[ca_secret]["isCA"] is True
    read = {ref for _, template, _ in all_pods(objects) for ref in secret_volumes(template)}
    assert {"specdec-tls", "specdec-tls-client"} <= read
    assert set(k8s_secrets.TLS_SECRETS) == {"specdec-tls", "specdec-tls-client"}


def secret_volumes(template: dict) -> set[str]:
    names = set()
    for volume in template["spec"].get("volumes", []):
        sources = volume.get("projected", {}).get(
            "sources", [{"secret": volume["secret"]}] if "secret" in volume else []
        )
        names |= {s["secret"].get("name") or s["secret"].get("secretName") for s in sources if "secret" in s}
    return names


def test_the_models_volume_owner_runs_one_root_step_and_audits_the_rest():
    """components/models-volume-owner lets the fetch Job give a root-owned share (GKE Filestore) to uid 10001:
    one init container runs as root, may only chown, and chowns; the namespace enforces `baseline` and still
    warns and audits `restricted`. Without it nothing runs as root and `restricted` is enforced. Caught
    before: a fresh Filestore share stayed unwritable for the Job (fetch_model.py now says so, naming it)."""
    for variant, component in (("gpu", False), ("gpu+models-volume-owner", True)):
        objects = render(variant)
        labels = named(objects, "Namespace", NAMESPACE)["metadata"]["labels"]
        roots = [
            (where, c)
            for where, t, _ in all_pods(objects)
            for c in t["spec"].get("initContainers", []) + t["spec"]["containers"]
            if c.get("securityContext", {}).get("runAsUser") == 0
        ]
        if not component:
            assert labels["pod-security.kubernetes.io/enforce"] == "restricted" and not roots
            continue
        assert labels["pod-security.kubernetes.io/enforce"] == "baseline"
        assert labels["pod-security.kubernetes.io/warn"] == labels["pod-security.kubernetes.io/audit"] == "restricted"
        assert [(where, c["name"]) for where, c in roots] == [("Job/specdec-models-fetch", "own-models-volume")]
        security = roots[0][1]["securityContext"]
        assert security["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
        assert roots[0][1]["command"] == ["chown", "10001:10001", "/models"]
        assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
