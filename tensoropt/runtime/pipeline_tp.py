"""Tensor parallelism inside pipeline stages.

The stage modules ``torch.distributed.pipelining`` cuts are traced graphs (``torch.export`` unflattened into
``InterpreterModule``s). Their submodules are still called as modules (``call_module``), so module hooks fire,
but a linear is an ``InterpreterModule`` whose graph calls ``aten.linear`` on its ``weight`` and ``bias``:
torch's ``ColwiseParallel`` / ``RowwiseParallel`` shard ``nn.Linear`` only. So each linear the plan shards is
given back as an ``nn.Linear`` holding the very same parameters (after checking that its graph is exactly one
``aten.linear`` of its input), and the stage's block copies are then sharded by ``tensor_parallel.shard_copy``
as the un-piped engine shards the model. The ops between the linears were traced with the shapes the model
asked for: a model that takes head counts from its tensors (``view(b, s, -1, head_dim)``, which
``tensor_parallel`` requires anyway) is traced with that ``-1`` and runs on its rank's share of heads.

The sharded-versus-whole check (``tp_guard``) runs on the whole model before it is cut, on its original
block copies.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import TensorOptError
from .tensor_parallel import check_degree, shard_copy, sharded_branches
from .torch_engine import block_modules


def check_before_cutting(model: nn.Module, plan: dict, tp_mesh, device: torch.device, example_inputs) -> None:
    """``tp_guard`` on the uncut model's first copy of every sharded block (a one-line error if the sharded copy
    computes something else)."""
    from .tp_guard import check_sharded_blocks
    first = {}
    for block, branches in sharded_branches(plan).items():
        check_degree(block, branches, tp_mesh.size())
        first[block] = (block_modules(model, {"blocks": [{"block": block}]})[0], branches)
    check_sharded_blocks(model, example_inputs, first, tp_mesh, device)


def shard_stage(stage_module: nn.Module, plan: dict, tp_mesh) -> None:
    """Shard, in place, the linears of every block copy this stage holds over ``tp_mesh``."""
    for block, branches in sharded_branches(plan).items():
        for name in block_modules(stage_module, {"blocks": [{"block": block}]}):
            copy = stage_module.get_submodule(name)
            for linear in {n for b in branches for n in (*b["column"], *b["row"])}:
                _restore_linear(copy, linear, f"{name}.{linear}")
            shard_copy(copy, branches, tp_mesh)


def _restore_linear(copy: nn.Module, name: str, full_name: str) -> None:
    """Replace the traced linear ``name`` of ``copy`` by an ``nn.Linear`` over the same parameters."""
    traced = copy.get_submodule(name)
    if isinstance(traced, nn.Linear):
        return
    calls = [n for n in getattr(traced, "graph", torch.fx.Graph()).nodes if n.op == "call_function"]
    weight, bias = traced._parameters.get("weight"), traced._parameters.get("bias")
    if len(calls) != 1 or calls[0].target is not torch.ops.aten.linear.default or weight is None or weight.dim() != 2:
        raise TensorOptError(f"pipeline stage module {full_name} is not one linear (aten.linear on its weight) after "
                             "tracing, so tensor parallelism cannot shard it inside a pipeline: plan with --tp 1 or "
                             "--pp 1")
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    linear.weight = weight
    if bias is not None:
        linear.bias = bias
    owner, _, attr = name.rpartition(".")
    setattr(copy.get_submodule(owner) if owner else copy, attr, linear)


__all__ = ["check_before_cutting", "shard_stage"]
