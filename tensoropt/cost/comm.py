"""Collective communication times on the links a group really crosses (TAPS, Li et al.,
arXiv 2301.04285: price communication by topology, not by volume).

Ranks are laid out with tensor parallelism innermost, then data, then pipeline parallelism (the
Megatron-LM order), so a group is described by its size and the rank stride between members.
A group inside one node runs a ring over NVLink; a group spanning nodes runs the hierarchical
algorithm: reduce-scatter inside each node, the inter-node step on 1/g of the data over every
GPU's own NIC in parallel, all-gather inside the node (NCCL's tree/ring hierarchy, as modelled by
TAPS). Ring costs: all-reduce 2(n-1)/n * M/B + 2(n-1)*alpha; all-gather and reduce-scatter
(n-1)/n * M/B + (n-1)*alpha (Thakur et al., 2005; Patarasuk & Yuan, 2009). B is the bandwidth the
profile measured for that collective (``Link.bytes_per_s``). A tensor sent as ``units`` separate
collectives (ZeRO-3 and FSDP gather and reduce layer by layer) pays the latency once per unit.
In a node without a switch (``Link.direct_peers``: a 4-GPU board wiring each GPU's NVLinks to its peers) a group
reaches only the links between its members: (m - 1) / direct_peers of the GPU's rate (``Link.share``).
"""

from __future__ import annotations

import numpy as np

from .profile import Cluster, Link


def group_layout(size: int, stride: int, devices_per_node: int) -> tuple[int, int]:
    """(members per node, nodes spanned) of a group of ``size`` ranks spaced ``stride`` apart."""
    if size <= 1:
        return 1, 1
    per_node = max(1, min(size, devices_per_node // stride)) if stride < devices_per_node else 1
    return per_node, -(-size // per_node)


def _ring(nbytes, n: int, link: Link, collective: str, units: int = 1):
    """Ring time of ``nbytes`` sent as ``units`` equal collectives. ``nbytes`` may be a numpy array
    (one value per plan); nothing to send costs nothing."""
    if n <= 1:
        return 0.0 * nbytes
    passes = 2.0 if collective == "all_reduce" else 1.0
    rate = link.bytes_per_s(collective) * float(link.share(n))
    t = passes * ((n - 1) / n * nbytes / rate + units * (n - 1) * link.latency_s)
    return np.where(nbytes > 0, t, 0.0) if isinstance(nbytes, np.ndarray) else (t if nbytes > 0 else 0.0)


def _collective(nbytes, size: int, stride: int, cluster: Cluster, collective: str, units: int = 1) -> float:
    per_node, nodes = group_layout(size, stride, cluster.devices_per_node)
    intra, inter = cluster.profile.intra_node, cluster.profile.inter_node
    if nodes == 1:
        return _ring(nbytes, per_node, intra, collective, units)
    # hierarchical: intra-node reduce-scatter / all-gather around an inter-node step on 1/g of the data
    return (_ring(nbytes, per_node, intra, collective, units)
            + _ring(nbytes / per_node, nodes, inter, collective, units))


def collective_rows_s(nbytes: np.ndarray, size: np.ndarray, stride: np.ndarray, cluster: Cluster, collective: str,
                      units: np.ndarray | int = 1) -> np.ndarray:
    """``_collective`` of many groups at once, one per row (``size``, ``stride`` and ``units`` arrays beside
    ``nbytes``): the same ring and hierarchical prices, computed in one pass over the rows instead of one call per
    group shape (the search prices the data-parallel collectives of every plan it keeps this way)."""
    size, stride = np.asarray(size, dtype=np.int64), np.asarray(stride, dtype=np.int64)
    devices_per_node = cluster.devices_per_node
    per_node = np.where((size > 1) & (stride < devices_per_node),
                        np.maximum(1, np.minimum(size, devices_per_node // np.maximum(stride, 1))), 1)
    nodes = np.where(size > 1, -(-size // per_node), 1)
    intra, inter = cluster.profile.intra_node, cluster.profile.inter_node
    return (_ring_rows(nbytes, per_node, intra, collective, units)
            + _ring_rows(nbytes / per_node, nodes, inter, collective, units))


def _ring_rows(nbytes: np.ndarray, n: np.ndarray, link: Link, collective: str, units) -> np.ndarray:
    """``_ring`` per row, with ``n`` members per row (0 where ``n`` is 1 or nothing is sent)."""
    passes = 2.0 if collective == "all_reduce" else 1.0
    rate = link.bytes_per_s(collective) * link.share(n)
    t = passes * ((n - 1) / n * nbytes / rate + units * (n - 1) * link.latency_s)
    return np.where((n > 1) & (nbytes > 0), t, 0.0)


def all_reduce_s(nbytes, size: int, stride: int, cluster: Cluster, units: int = 1):
    return _collective(nbytes, size, stride, cluster, "all_reduce", units)


def all_gather_s(nbytes, size: int, stride: int, cluster: Cluster, units: int = 1):
    """``nbytes`` is the size of the gathered (full) tensor."""
    return _collective(nbytes, size, stride, cluster, "all_gather", units)


def reduce_scatter_s(nbytes, size: int, stride: int, cluster: Cluster, units: int = 1):
    """``nbytes`` is the size of the full (unreduced) tensor."""
    return _collective(nbytes, size, stride, cluster, "reduce_scatter", units)


def p2p_s(nbytes, crosses_node, cluster: Cluster):
    """Point-to-point send of ``nbytes`` (numbers, or numpy arrays with ``crosses_node`` per entry)."""
    inter, intra = cluster.profile.inter_node, cluster.profile.intra_node
    bandwidth = np.where(crosses_node, inter.effective_bytes_per_s * inter.share(2),
                         intra.effective_bytes_per_s * intra.share(2))
    latency = np.where(crosses_node, inter.latency_s, intra.latency_s)
    return np.where(np.asarray(nbytes) > 0, nbytes / bandwidth + latency, 0.0)


def all_to_all_s(nbytes, size: int, stride: int, cluster: Cluster):
    """All-to-all of ``nbytes`` per rank (each rank keeps 1/n of it and sends every other member its 1/n): the
    expert-parallel dispatch and combine of Mixture-of-Experts layers (Lepikhin et al., GShard, 2020; NCCL runs it as
    concurrent send/receive pairs). Members in the rank's node take (per_node - 1)/n of the bytes over NVLink, the
    others (n - per_node)/n over the rank's own NIC; both parts are summed (the links run at once, but the exchange
    ends with its slower half and the NIC's congestion is not modelled: a conservative price). Latency once per peer
    link kind and member. The profile's ``all_to_all`` bandwidth where it measured one, else the link's effective."""
    if size <= 1:
        return 0.0 * nbytes
    per_node, nodes = group_layout(size, stride, cluster.devices_per_node)
    intra, inter = cluster.profile.intra_node, cluster.profile.inter_node
    t = ((per_node - 1) / size * nbytes / (intra.bytes_per_s("all_to_all") * float(intra.share(per_node)))
         + (per_node - 1) * intra.latency_s)
    if nodes > 1:
        t = t + (size - per_node) / size * nbytes / inter.bytes_per_s("all_to_all") + (nodes - 1) * inter.latency_s
    return np.where(nbytes > 0, t, 0.0) if isinstance(nbytes, np.ndarray) else (t if nbytes > 0 else 0.0)
