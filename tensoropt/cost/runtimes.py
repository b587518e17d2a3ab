"""Whose runtime a cost model prices (``ModelCost.runtime``): what differs between the runtimes the public benchmarks
price and the planner's own, beyond the plan itself."""

from __future__ import annotations

from enum import Enum


class Runtime(str, Enum):
    """Whose runtime a cost model prices: the planner prices ours; the public benchmarks price the runtimes their
    rows ran, which differ in the copies around their tensor-parallel collectives (``cost.tp_copies``) and in how
    they sum the micro-batches' gradients (``cost.accumulation``)."""

    OURS = "ours"                    # batch-first stream, in-place sums, per-sample gathers on views (eager)
    MEGATRON = "megatron"            # Megatron-LM: sequence-first stream, in-place sums, fused gradient accumulation
    TORCH_STYLES = "torch-styles"    # torch's ColwiseParallel / RowwiseParallel (torchtitan, KempnerForge)

    @property
    def sequence_first(self) -> bool:
        """Its sequence-parallel collectives run along dim 0: no layout copies at any batch."""
        return self is Runtime.MEGATRON

    def redistributes(self, compiled: bool) -> bool:
        """Whether its batch-first sequence-parallel collectives go through torch's redistribution, which copies
        (reduce-scatters concatenate at any batch, all-gathers copy past batch 1): torch's styles, and ours under
        ``torch.compile`` (which traces it); ours eager gathers each sample on views, Megatron-LM's sequence-first
        stream needs no copy."""
        return not self.sequence_first and (compiled or self is not Runtime.OURS)

    @property
    def functional_sums(self) -> bool:
        """It sums a row linear's output and a column linear's input gradient with torch's functional all-reduce,
        which clones its input (without sequence parallelism; ``cost.tp_copies.reduce_copies_s``)."""
        return self is Runtime.TORCH_STYLES

    @property
    def fuses_accumulation(self) -> bool:
        """Its weight-gradient products add into the float32 gradient buffer themselves (Megatron-LM's
        ``--gradient-accumulation-fusion``, on by default with Transformer Engine): no separate sum a micro-batch."""
        return self is Runtime.MEGATRON


__all__ = ["Runtime"]
