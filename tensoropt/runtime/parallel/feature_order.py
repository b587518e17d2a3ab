"""Parameters held in another feature order than the model's own: fused projections under tensor parallelism.

A fused projection read as segments (``[q | k | v]``, ``[gate | up]``) is sharded by first putting its output
features in the order that gives each rank its part of every segment (``runtime.parallel.tp_styles``); its parameter
is then a DTensor of the *reordered* value. The order is recorded on the module that owns it
(``FEATURE_ORDER``), and whatever moves whole values into or out of the run goes through here: the
materialiser puts the model's initial values into run order, full state dicts and checkpoints take them back
to the model's order. Values outside the run are therefore always in the model's own order, and a checkpoint
written under one plan loads under any other.
"""

from __future__ import annotations

import torch
from torch import nn

from ..names import script_name

FEATURE_ORDER = "_tensoropt_feature_order"   # module attribute: {param name: (dim, order)}


def feature_orders(model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    """{parameter name as the script knows it: (dim, order)} of every reordered parameter in ``model``: its
    value as the run holds it is the model's own value indexed by ``order`` along ``dim``."""
    out = {}
    for name, module in model.named_modules():
        for param, (dim, order) in getattr(module, FEATURE_ORDER, {}).items():
            out[script_name(f"{name}.{param}" if name else param)] = (dim, order)
    return out


def in_model_order(value: torch.Tensor, dim: int, order: torch.Tensor) -> torch.Tensor:
    """A full value held in run order, in the model's own feature order."""
    return value.index_select(dim, torch.argsort(order).to(value.device))


def in_run_order(value: torch.Tensor, dim: int, order: torch.Tensor) -> torch.Tensor:
    """A full value in the model's own feature order, in the order the run holds it."""
    return value.index_select(dim, order.to(value.device))


__all__ = ["FEATURE_ORDER", "feature_orders", "in_model_order", "in_run_order"]


def in_model_order_chunks(state: dict, orders: dict[str, tuple[int, torch.Tensor]]) -> dict:
    """``state`` (a ``get_state_dict`` model or optimizer state, by parameter name) with every reordered
    DTensor replaced by a ``ShardedTensor`` of the same local memory cut into the chunks it holds *in the
    model's order*: what ``torch.distributed.checkpoint`` saves from and loads into, so a checkpoint holds the
    model's own order and reshards onto any plan (the chunks are views: a load fills the run's tensors)."""
    out = dict(state)
    for name, value in state.items():
        target = name if name in orders else None
        if isinstance(value, dict):                     # optimizer state: {param name: {"exp_avg": ..., ...}}
            out[name] = in_model_order_chunks(value, orders) if name != "state" else {
                param: in_model_order_chunks(states, {k: orders[param] for k in states} if param in orders else {})
                for param, states in value.items()}
        elif target is not None and hasattr(value, "device_mesh"):
            out[name] = _model_order_chunks(value, *orders[target])
    return out


def _model_order_chunks(value, dim: int, order: torch.Tensor):
    """A ShardedTensor over this rank's part of the DTensor ``value`` (global value in run order, see above)."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    (chunk,) = value.__create_chunk_list__()
    local, offsets = value.to_local(), list(chunk.offsets)
    start, length = offsets[dim], local.shape[dim]
    model_index = order[start:start + length].tolist()
    shards, i = [], 0
    while i < length:                                   # runs of consecutive features in the model's order
        j = i + 1
        while j < length and model_index[j] == model_index[j - 1] + 1:
            j += 1
        at = list(offsets)
        at[dim] = model_index[i]
        shards.append(Shard.from_tensor_and_offsets(local.narrow(dim, i, j - i), at, dist.get_rank()))
        i = j
    return init_from_local_shards(shards, *value.shape)
