"""The copies a runtime makes around its tensor-parallel collectives (issue 35): pure functions of a block copy's branch
bytes, the plan's shape and the profile, which ``cost.layer.BlockCost`` adds to its collectives.

A batch-first stream [b, s, h] under sequence parallelism is sharded along the sequence, dim 1. torch's functional
collectives gather and scatter along dim 0 (``torch.distributed._functional_collectives``), so along dim 1:
- a reduce-scatter first concatenates the input's chunks into a new tensor (``torch._utils._chunk_or_narrow_cat``);
- an all-gather's result is moved from dim 0 to dim 1 (``torch._utils._maybe_view_chunk_cat``): a view only where the
  batch dim is 1.
Our eager runtime gathers each sample on views of one buffer, coalesced, and reduce-scatters on views at batch 1 and
on the concatenated chunks past it (``runtime.parallel.sequence_collectives``): the reduce-scatters' copies past
batch 1 only. Compiled blocks trace torch's redistribution (its reduce-scatters concatenate at any batch, its gathers
copy past batch 1), as runtimes on torch's own styles do eagerly too (``Runtime.TORCH_STYLES``: torchtitan's,
KempnerForge's). Without sequence parallelism our eager runtime sums in
place, the row linears' partial outputs in the forward (``runtime.parallel.tp_styles._SumOfPartials``) and the column
linears' input gradients in the backward (``tp_styles._CopyToRanks``), as Megatron-LM does; torch's
``RowwiseParallel`` and ``ColwiseParallel`` sum each with a functional all-reduce, which clones its input
(``_c10d_functional.all_reduce``): two copies per sharded branch (``Runtime.TORCH_STYLES``), and inductor reduces
in place where it can (``_inductor/comm_lowering.py``): compiled blocks none. Megatron-LM's stream is sequence-first
and all-reduces in place: none of these (``Runtime.MEGATRON``).
Each copy reads and writes the whole tensor once, at the profile's copy rate (``DeviceProfile.copy_bytes_per_s``).
"""

from __future__ import annotations

from .profile import DeviceProfile
from .runtimes import Runtime


def copy_s(nbytes: float, profile: DeviceProfile) -> float:
    """One copy of ``nbytes``: read and written once, one kernel."""
    return 2 * nbytes / profile.copy_bytes_per_s + profile.kernel_overhead_s


def sp_copies_s(branches: list[tuple[float, float, bool]], micro_batch: int, tokens: float, compiled: bool,
                profile: DeviceProfile, runtime: Runtime = Runtime.OURS) -> tuple[float, float]:
    """(the copies beside one SP copy's collectives, those beside its backward's gathers again), ``branches`` as
    (row output bytes, column input bytes, sharded) per branch and sample, ``tokens`` samples' worth on the rank. A
    sharded branch gathers its input (backward: a reduce-scatter) and reduce-scatters its output (backward: a
    gather); a replicated one gathers twice; every branch gathers its kept input again in the backward."""
    if runtime.sequence_first:
        return 0.0, 0.0
    # ours eager: gathers on views, reduce-scatters on views at batch 1 and concatenated past it
    gathers = micro_batch > 1 and runtime.redistributes(compiled)
    scatters = micro_batch > 1 or runtime.redistributes(compiled)
    total = 0.0
    for out_bytes, _, sharded in branches:
        one = copy_s(out_bytes * tokens, profile)
        if sharded:
            total += (2 * one if scatters else 0.0) + (2 * one if gathers else 0.0)
        elif gathers:
            total += 2 * one
    regathers = sum(copy_s(in_bytes * tokens, profile) for _, in_bytes, _ in branches) if gathers else 0.0
    return total, regathers


def reduce_copies_s(sharded_out_bytes: list[float], tokens: float, compiled: bool, profile: DeviceProfile,
                    runtime: Runtime = Runtime.OURS) -> float:
    """The functional all-reduce copies of one eager TP copy without SP, torch's styles' only: two per sharded
    branch (its output's sum in the forward, its input gradient's in the backward); in-place sums make none."""
    if compiled or not runtime.functional_sums:
        return 0.0
    return sum(2 * copy_s(b * tokens, profile) for b in sharded_out_bytes)


def layout_change_copy_s(nbytes: float, micro_batch: int, compiled: bool, profile: DeviceProfile,
                         runtime: Runtime = Runtime.OURS) -> float:
    """The gather at an SP chain's end moves a batch-first stream to dim 1 by torch's redistribution: a copy past
    batch 1."""
    return copy_s(nbytes, profile) if micro_batch > 1 and runtime.redistributes(compiled) else 0.0


__all__ = ["copy_s", "layout_change_copy_s", "reduce_copies_s", "sp_copies_s"]
