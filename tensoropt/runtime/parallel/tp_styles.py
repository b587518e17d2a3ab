"""How one linear is sharded for tensor parallelism: ``nn.Linear`` and ``transformers``' ``Conv1D``, and fused
projections whose output features the model reads as segments.

``torch``'s ``ColwiseParallel`` / ``RowwiseParallel`` shard ``nn.Linear`` only, and split output features into
contiguous blocks. Two cases need more:

- ``Conv1D`` (GPT-2 in ``transformers``) stores its weight as (in, out) and computes ``x @ W + b``: output
  features are the weight's dim 1, input features dim 0. Under these styles it runs on DTensors as
  ``nn.Linear`` does (its ``view`` to ``nf`` features sees the global shape).
- A fused projection read as segments (``[q | k | v]`` by ``chunk(3)``, ``[gate | up]`` by ``chunk(2)``) must
  give rank r the r-th part of *every* segment, as Megatron-LM lays out its fused QKV. Its output features are
  put in that order (``space.fused.segment_order``) and then split contiguously: the rank computes
  ``[q_r | k_r | v_r]`` and the model's own ``chunk`` finds its share of each segment. The order is recorded
  on the module (``runtime.parallel.feature_order``) for everything that moves whole values in or out of the run.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ...space.fused import segment_order
from ...space.run_plan import Branches
from ...space.tp_check import linear_kind
from .feature_order import FEATURE_ORDER
from .sequence_collectives import partial_sum, scatter_sequence
from .sequence_parallel import apply_sequence_parallel


class _CopyToRanks(torch.autograd.Function):
    """A column linear's input, equal on every rank, as a ``Replicate`` DTensor; backward: the ranks' partial input
    gradients summed in place (Megatron-LM's copy to the model-parallel region, whose backward all-reduces the
    gradient it is handed). torch's ``ColwiseParallel`` wraps the input with ``DTensor.from_local``, whose backward
    redistributes the ``Partial`` gradient with a functional all-reduce, which copies it first. The gradient summed
    here is the linear's own input gradient (its matmul's output), which nothing else reads."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):
            return grad, None
        if not partial_sum(grad):
            return grad.redistribute(ctx.mesh, [Replicate()]).to_local(), None
        local = grad._local_tensor
        dist.all_reduce(local, group=ctx.mesh.get_group())
        return local, None


class Copies(ColwiseParallel):
    """``ColwiseParallel`` whose input gradient is summed over the ranks in place (``_CopyToRanks``) where its input
    is a plain tensor, in eager mode; under ``torch.compile`` (which traces torch's redistribution: inductor reduces
    in place where it can) and for DTensor inputs (sequence parallelism's gathered stream) torch's own."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        if not isinstance(x, DTensor) and tuple(input_layouts) == (Replicate(),) \
                and tuple(desired_input_layouts) == (Replicate(),) and not torch.compiler.is_compiling():
            return _CopyToRanks.apply(x, device_mesh)
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)


class Columns(Copies):
    """Output features split over the ranks (dim 1 of a ``Conv1D`` weight), in ``order`` where one is given."""

    def __init__(self, transposed: bool, order: torch.Tensor | None) -> None:
        super().__init__()
        self.transposed, self.order = transposed, order

    def _partition(self, _name: str, module: nn.Module, mesh) -> None:
        orders = {}
        for name, param in list(module.named_parameters(recurse=False)):
            dim = 1 if self.transposed and name == "weight" else 0
            value = param.detach()
            if self.order is not None:
                value = value.index_select(dim, self.order.to(value.device))
                orders[name] = (dim, self.order)
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(value, mesh, [Shard(dim)], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))
        if orders:
            setattr(module, FEATURE_ORDER, orders)

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        return distribute_module(module, mesh, self._partition,
                                 partial(self._prepare_input_fn, self.input_layouts, (Replicate(),)),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class _SumOfPartials(torch.autograd.Function):
    """The sum over the tensor-parallel ranks of a row linear's partial output, all-reduced in place into the
    matmul's own output and handed back as a plain tensor (Megatron-LM's reduce from the model-parallel region).

    torch's ``RowwiseParallel`` redistributes the partial DTensor to ``Replicate()`` (a functional all-reduce,
    which copies its input) and hands back ``to_local()``: a view made inside a custom autograd function, which
    autograd forbids to modify in place, while models add into a row linear's output in place (Falcon's parallel
    attention and MLP: ``mlp_output += attention_output``). Here the output is the partial sum's own storage,
    summed in place: no copy, and the model may modify it. The gradient of every rank's partial output is the
    whole output's gradient: a replicated DTensor (as torch's redistribution gives it)."""

    @staticmethod
    def forward(ctx, partial):
        ctx.mesh = partial.device_mesh
        local = partial._local_tensor
        dist.all_reduce(local, group=ctx.mesh.get_group())
        return local

    @staticmethod
    def backward(ctx, grad):
        return DTensor.from_local(grad, ctx.mesh, [Replicate()], run_check=False)


class Rows(RowwiseParallel):
    """``RowwiseParallel`` whose whole output is summed in place and is a tensor of its own (``_SumOfPartials``);
    under sequence parallelism (``use_local_output=False``, reduce-scattered to ``Shard(1)``) torch's own.

    Under ``torch.compile`` dynamo traces the in-place sum as a functional all-reduce whose output it treats as
    the function's view, so there the sum is torch's and its ``to_local()`` view is cloned (inductor schedules
    that copy with the rest of the block; whether it fuses it away is not measured)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if use_local_output and isinstance(outputs, DTensor) and tuple(output_layouts) == (Replicate(),) \
                and partial_sum(outputs):
            if not torch.compiler.is_compiling():
                return _SumOfPartials.apply(outputs)
            return RowwiseParallel._prepare_output_fn(output_layouts, True, mod, outputs, device_mesh).clone()
        if not use_local_output and isinstance(outputs, DTensor) and tuple(output_layouts) == (Shard(1),) \
                and (share := scatter_sequence(outputs)) is not None:
            return share          # a batch-1 stream reduce-scattered on views (``sequence_collectives``)
        return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


class ConvRows(Rows):
    """``RowwiseParallel`` for a ``Conv1D``: its (in, out) weight split on dim 0, its bias replicated."""

    def _partition(self, _name: str, module: nn.Module, mesh) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if name == "weight" else Replicate()
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param, mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        return distribute_module(module, mesh, self._partition,
                                 partial(self._prepare_input_fn, self.input_layouts, (Shard(-1),)),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def column_style(module: nn.Module, segments: tuple[int, ...] | None, tp: int) -> ColwiseParallel:
    """The style that shards ``module``'s output features over ``tp`` ranks (``segments``: its fused layout)."""
    transposed = linear_kind(module) == "conv1d"
    if not transposed and not segments:
        return Copies()
    return Columns(transposed, torch.tensor(segment_order(tuple(segments), tp)) if segments else None)


def row_style(module: nn.Module, sequence_parallel: bool = False) -> RowwiseParallel:
    """The style that shards ``module``'s input features (the ranks' partial outputs are summed: all-reduced,
    or reduce-scattered along the sequence, dim 1, into a sequence-sharded DTensor under sequence parallelism)."""
    kwargs = dict(output_layouts=Shard(1), use_local_output=False) if sequence_parallel else {}
    return ConvRows(**kwargs) if linear_kind(module) == "conv1d" else Rows(**kwargs)


def shard_copy(copy: nn.Module, branches: Branches, tp_mesh, sp_layout: Branches | None = None, name: str = "",
               handoff: tuple[bool, bool] = (False, False), relay: dict | None = None,
               stream_argument: int | None = None) -> None:
    """Shard one copy of a block: its branches' column and row linears, as the layout describes them; with
    ``sp_layout`` (every branch of the block) the copy runs sequence-parallel too."""
    if branches:
        parallelize_module(copy, tp_mesh, styles(copy, branches, tp_mesh.size(), sp_layout is not None))
    if sp_layout is not None:
        apply_sequence_parallel(copy, name, sp_layout, branches, tp_mesh, handoff, relay, stream_argument)


def styles(copy: nn.Module, branches: Branches, tp: int, sequence_parallel: bool = False) -> dict:
    """``parallelize_module``'s plan for one block copy: module name -> its column or row style (under sequence
    parallelism the row linears reduce-scatter along the sequence)."""
    out = {}
    for branch in branches:
        out |= {name: column_style(copy.get_submodule(name), branch.segments_of(name), tp) for name in branch.column}
        out |= {name: row_style(copy.get_submodule(name), sequence_parallel) for name in branch.row}
    return out


__all__ = ["Columns", "ConvRows", "Copies", "Rows", "column_style", "row_style", "shard_copy", "styles"]
