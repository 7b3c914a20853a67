"""Bundle 0 of the Ray launcher's placement group, the GPU rank 0 uses, is reserved on the Ray node the verify
process runs in (verify_service/rank_launchers.py), on a local two-node Ray cluster shaped to tempt PACK away:
the head, where this process is, has 1 CPU and the custom resource `specdec_rank0` (what the RayCluster's head
group offers); a worker has 2 CPUs. Without the pin PACK puts both bundles on the worker, and the launcher
refuses; with it bundle 0 lands on the head; a node without the resource is refused before anything is reserved."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from verify_service.rank_launchers import RayLauncher  # noqa: E402
from verify_service.settings import VerifySettings  # noqa: E402

RANK0 = VerifySettings().tp_ray_rank0_resource


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {RANK0: 1}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def launcher(cluster, rank0_resource: str) -> RayLauncher:
    return RayLauncher(2, cluster.address, "PACK", start_timeout_s=60, rank0_resource=rank0_resource)


def test_this_process_runs_on_the_head_that_offers_the_rank0_resource(cluster):
    here = ray.get_runtime_context().get_node_id()
    assert here == cluster.head_node.node_id
    assert [n["NodeID"] for n in ray.nodes() if n["Resources"].get(RANK0)] == [here]


def test_bundle_zero_lands_on_this_node_when_it_asks_for_the_rank0_resource(cluster):
    pinned = launcher(cluster, RANK0)
    try:
        pinned._reserve()  # raises if bundle 0 is elsewhere
        table = ray.util.placement_group_table(pinned.placement_group)
        assert table["bundles_to_node_id"][0] == cluster.head_node.node_id
        assert table["bundles_to_node_id"][1] != cluster.head_node.node_id  # the head has one CPU
    finally:
        pinned.stop(0)


def test_without_the_pin_pack_takes_bundle_zero_away_and_the_launcher_refuses(cluster):
    unpinned = launcher(cluster, "")
    with pytest.raises(RuntimeError, match="bundle 0 .* reserved on Ray node .* but rank 0 is this process"):
        unpinned._reserve()
    assert unpinned.placement_group is None  # given back


def test_a_node_without_the_resource_is_refused_before_anything_is_reserved(cluster):
    elsewhere = launcher(cluster, "specdec_rank0_of_another_group")
    with pytest.raises(RuntimeError, match="tp_ray_rank0_resource: this process's Ray node .* does not offer"):
        elsewhere._reserve()
    assert elsewhere.placement_group is None
