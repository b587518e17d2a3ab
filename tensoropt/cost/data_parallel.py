"""Data-parallel communication of a step and how much of it compute hides (ZeRO 0-3, FSDP2, DeepSpeed).

Split from ``cost.model`` (which prices the rest of a plan); pure functions of per-plan arrays and the cluster.
"""

from __future__ import annotations

import numpy as np

from .comm import collective_rows_s
from .profile import Cluster


def data_parallel_s(dp: np.ndarray, tp: np.ndarray, zero: np.ndarray, m: np.ndarray, weight_bytes: np.ndarray,
                     grad_bytes: np.ndarray, stage_s: np.ndarray, backward_s: np.ndarray, cluster: Cluster,
                     units: np.ndarray, serial: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(data-parallel communication seconds, the part of it not hidden behind compute), per step and plan.

    ZeRO 0: one all-reduce of the gradients, behind the last micro-batch's backward; ZeRO 1 the same volume as a
    reduce-scatter behind the backward and an all-gather ahead of the next forward. ZeRO 2: a
    reduce-scatter behind every micro-batch's backward and one all-gather of the updated weights.
    ZeRO 3: every micro-batch gathers the weights for its forward and again for its backward and
    reduce-scatters its gradients, unit by unit with one unit prefetched (``fsdp_exposed_s``). Hiding needs a
    device that communicates beside computing (``overlaps_communication``): where the collective runs on the
    compute cores (gloo on a CPU), all of it is exposed, and so is that of the ``serial`` rows, whose engine issues
    its collectives on the compute stream (DeepSpeed below ZeRO 3: ``deepspeed_memory.overlaps_comm``).
    Collectives are priced per row (``comm.collective_rows_s``: a dp group of ``dp`` ranks ``tp`` apart)."""
    comm, exposed = np.zeros(len(dp)), np.zeros(len(dp))
    # flat-buffer copy (FSDP2's copy-in and copy-out, DeepSpeed's flat buffers): read and write the tensor once, a large
    # contiguous copy at the profile's copy rate
    copy_s = 2 / cluster.profile.copy_bytes_per_s
    dp, tp, zero = np.asarray(dp), np.asarray(tp), np.asarray(zero)
    rows = np.flatnonzero((dp > 1) & (zero < 2))
    if len(rows):
        comm[rows] = collective_rows_s(grad_bytes[rows], dp[rows], tp[rows], cluster, "all_reduce")
        back, forward = backward_s[rows], stage_s[rows] - backward_s[rows]
        # ZeRO 1 runs the all-reduce's two halves apart: the reduce-scatter behind the last backward, the
        # all-gather of the updated weights unit by unit ahead of the next step's first forward (FSDP2 without
        # gradient sync until the last micro-batch; Megatron's distributed optimizer with
        # --overlap-param-gather)
        exposed[rows] = np.where(zero[rows] == 1, np.maximum(comm[rows] / 2 - back, 0.0)
                                 + np.maximum(comm[rows] / 2 - forward, 0.0),
                                 np.maximum(comm[rows] - back, 0.0))
    rows = np.flatnonzero((dp > 1) & (zero >= 2))
    if len(rows):
        w, g, n, d, t, u = (weight_bytes[rows], grad_bytes[rows], m[rows], dp[rows], tp[rows],
                            np.asarray(units)[rows])
        gather = collective_rows_s(w, d, t, cluster, "all_gather", u) + copy_s * w
        scatter = collective_rows_s(g, d, t, cluster, "reduce_scatter", u) + copy_s * g
        stage, back = stage_s[rows], backward_s[rows]
        three = zero[rows] == 3
        comm[rows] = np.where(three, n * (2 * gather + scatter), n * scatter + gather)
        exposed[rows] = np.where(three, n * fsdp_exposed_s(gather, scatter, stage - back, back, u),
                                 n * np.maximum(scatter - back, 0.0) + np.maximum(gather - stage, 0.0))
    if not cluster.profile.overlaps_communication:
        return comm, comm
    # a collective running beside compute takes SMs and memory bandwidth from it (NCCL's kernels run on the same
    # GPU): the compute it overlaps slows by the profile's fraction of the collective's time
    exposed = exposed + cluster.profile.overlap_slowdown * (comm - exposed)
    return comm, exposed if serial is None else np.where(serial, comm, exposed)


def fsdp_exposed_s(gather_s, scatter_s, forward_s, backward_s, units):
    """Exposed communication of one micro-batch under FSDP2 / ZeRO 3, per unit as FSDP2 runs it (torch
    ``fully_shard`` docs: one all-gather in flight ahead of the unit computing, forward and backward).

    The stage's ``units`` (block copies and the loose ops) each gather their weights before their forward and
    again before their backward, and reduce-scatter their gradients after it; all units alike, a unit
    gathers g = gather_s / units and scatters r = scatter_s / units. The forward's first gather and the
    backward's last reduce-scatter have nothing to hide behind; every other gather hides behind the previous
    unit's forward (f = forward_s / units), and in the backward the next unit's gather and this unit's
    reduce-scatter share the links behind one unit's backward (b = backward_s / units)."""
    g, r, f, b = gather_s / units, scatter_s / units, forward_s / units, backward_s / units
    hidden = (units - 1) * (np.maximum(g - f, 0.0) + np.maximum(g + r - b, 0.0))
    return g + r + hidden
