"""torch.distributed's tensor-in, tensor-out collectives under the names of the torch that runs.

torch 2.13 named them ``all_gather_single`` and ``reduce_scatter_single`` and deprecated ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` (a ``FutureWarning`` in every process that calls them, and a removal to come); the releases
before it that TensorOpt runs on (>= 2.4) have only the old names. The name is looked up at each call, so a test that
wraps torch's function sees the runtime's calls."""

from __future__ import annotations


def all_gather_single(output, input, group=None, async_op=False):   # noqa: A002 (torch's parameter names)
    """Every rank's ``input`` concatenated along dim 0 into ``output``."""
    import torch.distributed as dist
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=None, group=None, async_op=False):   # noqa: A002
    """``input`` summed (``op``) over the ranks, this rank's dim-0 share of it into ``output``."""
    import torch.distributed as dist
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=async_op)


__all__ = ["all_gather_single", "reduce_scatter_single"]
