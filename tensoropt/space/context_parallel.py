"""Which context-parallel degrees a model can run, and which the search tries by default.

Context parallelism (``Plan.cp``) splits every sample's sequence over cp ranks, each holding two of 2 cp equal chunks
(the load-balanced causal split, ``models.sequence``). The runtime runs it (``runtime.parallel.context_parallel``)
for models whose forward reads its sequence shard (the capture's ``context_parallel`` metadata is "": the built-in
``DecoderLM`` without token-routed layers), for sequences 2 cp divides, in the torch engine only, with pp 1 (tp
inside a node, ZeRO 1-3 beside it), eager kernels and no offload (the plan-level conditions:
``search.engines.unsupported``).

By default the search tries only degrees that leave each rank at least ``MIN_TOKENS_PER_RANK`` tokens of a sample:
below that a rank's products are too small for the all-gathers of keys and values to pay off, and the searches of
today's sequence lengths (2048) stay as they were. An explicit limit (``--cp``) names the degrees to search.
"""

from __future__ import annotations

from ..graph.ir import CONTEXT_PARALLEL_META

MIN_TOKENS_PER_RANK = 4096


def context_parallel_refusal(meta: str | None, seq_len: int | None, cp: int) -> str:
    """Why a model whose graph says ``meta`` (its ``context_parallel`` metadata; None: captured before it existed)
    cannot run its ``seq_len``-token sequences over ``cp`` ranks, in one line naming what to change; "" when it can."""
    if cp <= 1:
        return ""
    if meta is None:
        return "the graph was captured before context parallelism existed: capture the model again"
    if meta:
        return f"the model cannot run context-parallel: {meta}"
    if not seq_len:
        return "the graph has no sequence length to split"
    if seq_len % (2 * cp):
        return (f"context parallelism over {cp} ranks cuts each sequence into {2 * cp} equal chunks, and "
                f"{2 * cp} does not divide the sequence length {seq_len}: pick a --seq-len or --cp where it does")
    return ""


def graph_refusal(graph, cp: int) -> str:
    """``context_parallel_refusal`` of an ``OpGraph``."""
    raw = dict(graph.metadata).get(CONTEXT_PARALLEL_META)
    seq = int(graph.meta("seq_len") or 0) or None
    return context_parallel_refusal(raw, seq, cp)


def default_degrees(devices: int, seq_len: int | None) -> tuple[int, ...]:
    """The degrees > 1 searched without an explicit limit: dividing the devices and 2 cp the sequence, with at least
    ``MIN_TOKENS_PER_RANK`` tokens per rank."""
    if not seq_len:
        return ()
    return tuple(cp for cp in range(2, devices + 1) if devices % cp == 0 and seq_len % (2 * cp) == 0
                 and seq_len // cp >= MIN_TOKENS_PER_RANK)


__all__ = ["CONTEXT_PARALLEL_META", "MIN_TOKENS_PER_RANK", "context_parallel_refusal", "default_degrees",
           "graph_refusal"]
