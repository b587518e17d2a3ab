"""Nodes whose GPUs are wired to each other directly, without a switch (``Link.direct_peers``: a 4-GPU Hopper board
gives each of its 3 peers 6 of a GPU's 18 NVLinks): a group of m GPUs in such a node reaches (m - 1)/3 of the GPU's
link rate, so tensor parallelism over 2 of its GPUs pays three times the 4-GPU group's rate per byte."""

import dataclasses

import numpy as np
import pytest

from tensoropt.cost.comm import _collective, all_gather_s, all_to_all_s, collective_rows_s, p2p_s, reduce_scatter_s
from tensoropt.cost.profile import Cluster, DeviceProfile, Link, ProfileError, load_profile, load_profile_json
from tensoropt.errors import TensorOptError

DIRECT = "h200-141gb-4gpu"
NBYTES = 256e6


def _clusters(devices: int = 8) -> tuple[Cluster, Cluster]:
    """The same H200s in switched nodes of 4 and in directly wired ones."""
    direct = load_profile(DIRECT)
    switched = dataclasses.replace(direct, intra_node=dataclasses.replace(direct.intra_node, direct_peers=0))
    return Cluster(devices, 4, switched), Cluster(devices, 4, direct)


def _bandwidth_term(fn, size: int, cluster: Cluster) -> float:
    """The collective's time less its latency (the latency term does not depend on the wiring)."""
    return fn(NBYTES, size, 1, cluster) - fn(0.5 * NBYTES, size, 1, cluster)


def test_the_4gpu_profile_is_the_8gpu_one_with_directly_wired_links():
    direct, switched = load_profile_json(DIRECT), load_profile_json("h200-141gb")
    assert direct["intra_node"].pop("direct_peers") == 3
    assert "direct_peers" not in switched["intra_node"]
    for key in ("peak_flops", "matmul_efficiency", "memory_efficiency", "memory_bandwidth_bytes_per_s",
                "intra_node", "inter_node", "kernel_overhead_s", "grouped_matmul_efficiency"):
        assert direct[key] == switched[key], key


@pytest.mark.parametrize("fn", [all_gather_s, reduce_scatter_s])
def test_a_pair_of_directly_wired_gpus_reaches_a_third_of_the_rate_four_reach_all_of_it(fn):
    switched, direct = _clusters()
    assert _bandwidth_term(fn, 2, direct) == pytest.approx(3 * _bandwidth_term(fn, 2, switched))
    assert _bandwidth_term(fn, 3, direct) == pytest.approx(1.5 * _bandwidth_term(fn, 3, switched))
    assert _bandwidth_term(fn, 4, direct) == pytest.approx(_bandwidth_term(fn, 4, switched))
    # the latency term is the wiring's either way
    assert fn(0.0 + 1, 2, 1, direct) - fn(0.0 + 1, 2, 1, switched) == pytest.approx(0.0, abs=1e-9)


def test_across_nodes_only_the_step_inside_the_node_is_on_the_direct_links():
    """A data-parallel group of 4 with stride 2 holds 2 GPUs in each of 2 nodes: the hierarchical collective's
    inside-node part runs on the pair's links, the inter-node part on the NICs (a switch either way)."""
    switched, direct = _clusters()
    intra = direct.profile.intra_node
    pair_s = 0.5 * NBYTES / intra.effective_bytes_per_s
    delta = _collective(NBYTES, 4, 2, direct, "all_gather") - _collective(NBYTES, 4, 2, switched, "all_gather")
    assert delta == pytest.approx(pair_s * 3 - pair_s)


def test_a_send_between_two_directly_wired_gpus_and_the_all_to_all_use_the_links_between_them():
    switched, direct = _clusters()
    assert p2p_s(NBYTES, False, direct) - direct.profile.intra_node.latency_s == pytest.approx(
        3 * (p2p_s(NBYTES, False, switched) - switched.profile.intra_node.latency_s))
    assert p2p_s(NBYTES, True, direct) == pytest.approx(p2p_s(NBYTES, True, switched))
    assert all_to_all_s(NBYTES, 4, 1, direct) == pytest.approx(all_to_all_s(NBYTES, 4, 1, switched))
    two = all_to_all_s(NBYTES, 2, 1, direct) - all_to_all_s(0.5 * NBYTES, 2, 1, direct)
    assert two == pytest.approx(3 * (all_to_all_s(NBYTES, 2, 1, switched) - all_to_all_s(0.5 * NBYTES, 2, 1, switched)))


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter"])
def test_collectives_priced_per_row_equal_the_one_group_prices_on_direct_links(collective):
    cluster = Cluster(64, 4, load_profile(DIRECT))
    shapes = [(size, stride) for size in (1, 2, 3, 4, 8, 16) for stride in (1, 2, 4, 8)]
    nbytes = np.array([1e6 * (k + 1) for k in range(len(shapes))])
    size, stride = (np.array(column) for column in zip(*shapes))
    rows = collective_rows_s(nbytes, size, stride, cluster, collective)
    assert rows.tolist() == pytest.approx([_collective(b, s, t, cluster, collective) for b, (s, t) in
                                           zip(nbytes, shapes)], rel=1e-12)


def test_more_gpus_per_node_than_the_wiring_connects_is_refused_in_one_line():
    profile = load_profile(DIRECT)
    with pytest.raises(TensorOptError, match="--gpus-per-node 4 or less"):
        Cluster(16, 8, profile)
    assert Cluster(16, 2, profile).devices_per_node == 2


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_a_profile_with_a_bad_direct_peers_is_refused(tmp_path, bad):
    data = load_profile_json(DIRECT)
    data["intra_node"]["direct_peers"] = bad
    with pytest.raises(ValueError, match="direct_peers"):
        DeviceProfile.from_json(data)
    path = tmp_path / "bad.json"
    import json
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="direct_peers"):
        load_profile(str(path))


def test_a_switched_link_shares_its_whole_rate_with_any_group():
    link = Link(450e9, 5e-6, 0.8)
    assert link.share(2) == link.share(8) == 1.0
    direct = dataclasses.replace(link, direct_peers=3)
    assert direct.share(np.array([2, 3, 4, 8])).tolist() == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
