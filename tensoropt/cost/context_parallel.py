"""What context parallelism adds to a block copy: the attention's gathered keys and values (time and memory).

Context parallelism (``Plan.cp``) cuts each sample's sequence S into 2 cp chunks and gives cp rank r the chunks r
and 2cp-1-r (the load-balanced causal split of Megatron-LM's context parallelism and torchtitan's, as background).
Every op then runs on S / cp tokens of each sample, so its time and saved activations are the captured ones at
micro_batch / cp samples (``cost.layer``); the attention is the exception. The runtime this prices
(``models.transformer.Attention`` reading ``models.sequence``, ``runtime.parallel.context_parallel``) does not pass
keys and values around a ring: each copy's attention all-gathers the rank's keys and values (after rotary, before
any GQA repeat) over the cp ranks to the whole sequence, one all-gather for K and one for V, synchronous, not
overlapped with compute, and computes each of its two chunks' queries against the keys up to the chunk's end under
a bottom-right causal mask (flash: the fused kernels skip the masked tiles; eager: the causal mask's rows). The
load-balanced chunks give every rank 1/cp of the whole sequence's causal work, so the 1/cp scaling of every op holds
for the attention core too (its causal share, ``cost.ops.causal_fraction``, with it). Its backward
reduce-scatters the gathered tensors' gradients back (the same volume); a fully recomputed copy runs its forward,
all-gathers included, again in the backward.

Memory: what the attention's backward needs of the gathered K and V is kept as the rank's share and gathered again
when the backward first reads it (``runtime.parallel.context_parallel._Shares``, as Transformer Engine's all-gather
CP keeps its local K and V), and the attention reads the gathered kv heads as they are (grouped query rows, no GQA
repeat). So a copy keeps the captured activations x mb / cp, with the captured K and V (the repeated copies under
eager GQA) replaced by the share of the kv heads' (``extra_saved_bytes``), and holds the rest of the sequence's K and V
while its backward runs (``regathered_bytes``); the backward's gathers cost a second pass of all-gathers.

Which tensors are K and V is read from the graph (``attention_kv``): the second and third activation inputs of a
fused attention op (SDPA), or for eager attention the second operand of the core's first product (Q K^T, the core
``space.block`` finds) and the other operand of the product that reads the core's probabilities (P V).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..graph.ir import Op
from .comm import all_gather_s, reduce_scatter_s
from .profile import Cluster


@dataclass(frozen=True)
class AttentionKV:
    """Bytes per sample (the capture's batch of one) of one block copy's keys and values, all its attentions."""

    saved_bytes: float        # K and V as the attention saves them for its backward (GQA: the repeated copies)
    gathered_bytes: float     # K and V as the runtime all-gathers them (kv heads, before any repeat)

    def extra_saved_bytes(self, micro_batch: float, cp: int) -> float:
        """Bytes a copy keeps beyond its captured activations at ``micro_batch / cp`` samples (negative: fewer): the
        rank's share of the gathered K and V (kv heads, S / cp long) where the capture saved them as its attention
        does (for eager attention with GQA, the repeated copies, which the grouped attention under CP never makes)."""
        return (self.gathered_bytes - self.saved_bytes) * micro_batch / cp if cp > 1 else 0.0

    def regathered_bytes(self, micro_batch: float, cp: int) -> float:
        """What a copy's backward holds beyond its priced working set (the captured one at S / cp): the K and V
        gathered again (the rest of the sequence's beside the share), their gradients, which are the whole
        sequence's (the rest beside the share's the capture counts), and the gather's backward's reordered copy of
        one of them for its reduce-scatter (``runtime.parallel.context_parallel._GatherSequence``)."""
        if cp == 1:
            return 0.0
        return (2 * (1 - 1 / cp) + 0.5) * self.gathered_bytes * micro_batch

    def gather_s(self, micro_batch: float, cp: int, stride: int, cluster: Cluster) -> float:
        """One pass of all-gathers of K and V over the cp ranks (``stride``: the rank distance between them, tp in
        the dp x cp x tp mesh): the forward's, and the backward's of the kept shares. ``nbytes`` of ``all_gather_s``
        is the gathered (whole-sequence) tensor."""
        return all_gather_s(self.gathered_bytes * micro_batch, cp, stride, cluster) if cp > 1 else 0.0

    def scatter_s(self, micro_batch: float, cp: int, stride: int, cluster: Cluster) -> float:
        """The backward's reduce-scatters of the gathered K and V gradients back to their owners."""
        return reduce_scatter_s(self.gathered_bytes * micro_batch, cp, stride, cluster) if cp > 1 else 0.0


def attention_kv(ops: tuple[Op, ...], core: tuple[int, ...]) -> AttentionKV:
    """The K and V of a block's attentions (module doc); zero for a block without attention."""
    in_core = set(core)
    keys, values = [], []                                      # (meta, ref) read by the attention
    for i, op in enumerate(ops):
        acts = [(m, r) for m, r in zip(op.inputs, op.sources) if r.kind in ("local", "prev")]
        if op.kind == "attention" and len(acts) >= 3:
            keys.append(acts[1])
            values.append(acts[2])
        elif op.kind == "matmul" and len(acts) == 2 and i in in_core and _starts_core(ops, i, in_core):
            keys.append(acts[1])                               # Q K^T
        elif op.kind == "matmul" and len(acts) == 2 and i not in in_core and acts[0][1].kind == "local" \
                and acts[0][1].index in in_core:
            values.append(acts[1])                             # P V
    key_factors = [_repeat_factor(ops, ref, meta.numel) for meta, ref in keys]
    # V's repeat reads a slice of a fused projection where K's reads the rotary output: V is repeated as K is
    # (the same kv heads), which K's chain shows
    repeat = max(key_factors, default=1.0)
    value_factors = [_repeat_factor(ops, ref, meta.numel) if ref.kind != "local" or ops[ref.index].kind != "copy"
                     else max(_repeat_factor(ops, ref, meta.numel), repeat) for meta, ref in values]
    pairs = list(zip(keys + values, key_factors + value_factors))
    return AttentionKV(float(sum(meta.nbytes for (meta, _), _f in pairs)),
                       float(sum(meta.nbytes / f for (meta, _), f in pairs)))


def _starts_core(ops: tuple[Op, ...], i: int, core: set[int]) -> bool:
    """Whether product ``i`` of the core is its first (Q K^T: neither operand comes from the core)."""
    return not any(r.kind == "local" and r.index in core for r in ops[i].sources)


def _repeat_factor(ops: tuple[Op, ...], ref, numel: int) -> float:
    """How many times a GQA repeat (``repeat_interleave``: a copy of an expanded view) multiplied the keys or values
    the attention reads, 1 where they are not repeated: the runtime gathers them before the repeat."""
    if ref.kind != "local":
        return 1.0
    producer = ops[ref.index]
    sources = [r for r in producer.sources if r.kind == "local"]
    if producer.kind != "copy" or len(sources) != 1:
        return 1.0
    src = sources[0]
    origin = ops[src.index].outputs[src.slot].numel if src.slot < len(ops[src.index].outputs) else numel
    expanded = producer.inputs[0].numel if producer.inputs else numel
    # a repeat reads an expanded view of the whole unrepeated tensor; a copy of a slice (the V of a fused
    # projection) reads fewer elements than its source holds
    return expanded / origin if origin < expanded and expanded % origin == 0 else 1.0


__all__ = ["AttentionKV", "attention_kv"]
