"""How this machine's GPUs are wired to each other: through an NVSwitch, or directly (4-GPU boards).

On an NVSwitch node (DGX / HGX 8-GPU) ``nvidia-smi topo -m`` shows every pair of GPUs joined by all of a GPU's
NVLinks (``NV18`` on Hopper): each GPU reaches any peer at its whole link rate. On a board without a switch (HGX
4-GPU, H200 NVL with its 4-way bridge) each GPU's links are split over its peers (``NV6`` to each of 3 on Hopper):
a group of m GPUs of the node reaches only the links between its members, (m - 1) / peers of the rate. The launch
plans with that (``Link.direct_peers``), so tensor parallelism over a pair is priced at the pair's 6 links.

Read from ``nvidia-smi topo -m`` (the links of each pair) and ``nvidia-smi nvlink -s`` (each GPU's active links),
without a CUDA context; anything unreadable leaves the profile as it is.
"""

from __future__ import annotations

import re
import subprocess

from .gpus import NVIDIA_SMI, QUERY_TIMEOUT_S, Gpu

_TOPO_COLUMN = re.compile(r"^GPU(\d+)$")
_NV = re.compile(r"^NV(\d+)$")
_LINK_GPU = re.compile(r"^GPU (\d+):")
_ACTIVE_LINK = re.compile(r"^\s*Link \d+: [\d.]+ GB/s")


def parse_topology(text: str) -> dict[int, dict[int, int]]:
    """{GPU index: {peer index: NVLinks between them}} of an ``nvidia-smi topo -m`` matrix (pairs without NVLink left
    out)."""
    columns: list[int] = []
    pairs: dict[int, dict[int, int]] = {}
    for line in text.splitlines():
        fields = line.split()
        if not columns and fields and _TOPO_COLUMN.match(fields[0]) and len(fields) > 1 and \
                _TOPO_COLUMN.match(fields[1]):
            columns = [int(column[1]) for f in fields if (column := _TOPO_COLUMN.match(f))]
        elif columns and fields and (row := _TOPO_COLUMN.match(fields[0])):
            pairs[int(row[1])] = {peer: int(nv[1]) for peer, entry in zip(columns, fields[1:])
                                  if (nv := _NV.match(entry))}
    return pairs


def parse_links(text: str) -> dict[int, int]:
    """{GPU index: active NVLinks} of ``nvidia-smi nvlink -s``."""
    links: dict[int, int] = {}
    gpu = None
    for line in text.splitlines():
        if match := _LINK_GPU.match(line):
            gpu = int(match[1])
            links[gpu] = 0
        elif gpu is not None and _ACTIVE_LINK.match(line):
            links[gpu] += 1
    return links


def direct_peers(pairs: dict[int, dict[int, int]], links: dict[int, int], gpus: list[int]) -> int:
    """How many peers each of ``gpus`` splits its NVLinks over where they are wired directly (every peer joined by the
    same share of the GPU's links, all of them used); 0 for a switch (each pair shows all the links), or where the
    wiring is anything else."""
    found = set()
    for gpu in gpus:
        peers, total = pairs.get(gpu, {}), links.get(gpu, 0)
        counts = set(peers.values())
        if len(peers) < 1 or len(counts) != 1 or not total:
            return 0
        each = counts.pop()
        if each >= total or each * len(peers) != total:
            return 0
        found.add(len(peers))
    return found.pop() if len(found) == 1 else 0


def _smi(*args: str) -> str | None:
    try:
        result = subprocess.run([NVIDIA_SMI, *args], capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def wiring(devices: list[Gpu]) -> int:
    """``direct_peers`` of the GPUs a launch uses on this machine (0: switched, MIG instances, or unknown)."""
    if not devices or any(d.mig for d in devices):
        return 0
    topology, status = _smi("topo", "-m"), _smi("nvlink", "-s")
    if topology is None or status is None:
        return 0
    return direct_peers(parse_topology(topology), parse_links(status), [d.index for d in devices])


__all__ = ["direct_peers", "parse_links", "parse_topology", "wiring"]
