"""How the launcher finds GPUs wired to each other without a switch (``launcher.wiring``): from ``nvidia-smi topo -m``
and ``nvidia-smi nvlink -s`` as the driver prints them on a 4-GPU Hopper board (each pair NV6 of 18 links) and on an
8-GPU NVSwitch node (each pair NV18), and the launch then prices a pair's collectives on the pair's links."""

import pytest
from test_gpus import fake_smi, uuid  # noqa: F401  (the fixture)

from launcher.devices import detect
from launcher.wiring import direct_peers, parse_links, parse_topology

H200 = "NVIDIA H200"
LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def topology(gpus: int, nv: int) -> str:
    head = "\t" + "\t".join(f"GPU{i}" for i in range(gpus)) + "\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    rows = "".join(f"GPU{i}\t" + "\t".join("X" if j == i else f"NV{nv}" for j in range(gpus))
                   + f"\tSYS\t{i * 16}-{i * 16 + 15}\t{i}\t\tN/A\n" for i in range(gpus))
    return head + rows + "NIC0\t" + "\t".join("SYS" for _ in range(gpus)) + "\t X\n" + LEGEND


def nvlinks(gpus: int, name: str, active: int = 18, inactive: int = 0) -> str:
    return "".join(f"GPU {i}: {name} (UUID: {uuid(i)})\n"
                   + "".join(f"\t Link {k}: 26.562 GB/s\n" for k in range(active))
                   + "".join(f"\t Link {active + k}: <inactive>\n" for k in range(inactive)) for i in range(gpus))


def test_a_four_gpu_board_splits_each_gpus_links_over_its_three_peers():
    pairs, links = parse_topology(topology(4, 6)), parse_links(nvlinks(4, H200))
    assert pairs[0] == {1: 6, 2: 6, 3: 6} and pairs[3] == {0: 6, 1: 6, 2: 6}
    assert links == {0: 18, 1: 18, 2: 18, 3: 18}
    assert direct_peers(pairs, links, [0, 1, 2, 3]) == direct_peers(pairs, links, [1, 2]) == 3


def test_an_nvswitch_node_or_any_other_wiring_is_not_direct():
    assert direct_peers(parse_topology(topology(8, 18)), parse_links(nvlinks(8, H200)), list(range(8))) == 0
    # links down on one GPU, no NVLink at all, a GPU the listing lacks: left as the profile says
    pairs = parse_topology(topology(4, 6))
    assert direct_peers(pairs, parse_links(nvlinks(4, H200, active=12, inactive=6)), [0, 1]) == 0
    assert direct_peers(parse_topology(topology(4, 6).replace("NV6", "SYS")), parse_links(nvlinks(4, H200)), [0]) == 0
    assert direct_peers(pairs, parse_links(nvlinks(4, H200)), [0, 7]) == 0


def test_a_launch_on_a_four_gpu_board_plans_with_directly_wired_links(fake_smi):  # noqa: F811
    calls = fake_smi("".join(f"GPU {i}: {H200} (UUID: {uuid(i)})\n" for i in range(4)))
    (calls.parent / "topo.txt").write_text(topology(4, 6))
    (calls.parent / "nvlink.txt").write_text(nvlinks(4, H200))
    devices = detect(None, 4, None, None)
    assert devices.profile.name == "h200-141gb" and devices.profile.intra_node.direct_peers == 3
    assert devices.profile_name == "h200-141gb, its NVLinks wired directly to 3 peers (nvidia-smi topo)"
    # an NVSwitch node's H200s keep the profile's switched links
    (calls.parent / "topo.txt").write_text(topology(4, 18))
    assert detect(None, 4, None, None).profile.intra_node.direct_peers == 0
    # a profile that already says how its nodes are wired is planned with as it is
    assert detect(None, 4, None, "h200-141gb-4gpu").profile_name == "h200-141gb-4gpu"


@pytest.mark.parametrize("missing", ["topo", "nvlink"])
def test_a_driver_that_cannot_say_leaves_the_profile_as_it_is(fake_smi, missing):  # noqa: F811
    calls = fake_smi("".join(f"GPU {i}: {H200} (UUID: {uuid(i)})\n" for i in range(4)))
    for name, text in (("topo", topology(4, 6)), ("nvlink", nvlinks(4, H200))):
        if name != missing:
            (calls.parent / f"{name}.txt").write_text(text)
    assert detect(None, 4, None, None).profile.intra_node.direct_peers == 0
