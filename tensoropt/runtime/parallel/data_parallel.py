"""Data parallelism for the torch engine, with the model whole (``torch_engine``) or cut into pipeline stages
(``pipeline``): one function per case, both engines' paths calling the same ones.

The plan's ZeRO stage says what each data-parallel rank holds (Rajbhandari et al., SC'20), and each stage runs
with torch's own wrappers so that it communicates as ``cost.model`` prices it:

- ZeRO 0: DDP (``replicate``); gradients live in DDP's buckets (``gradient_as_bucket_view``), not in a second
  copy: one gradient's memory, as planned. It all-reduces on the last micro-batch's backward only
  (``ddp_micro_batch``; a pipeline stage's DDP is told so before each backward by ``pipeline_executor``).
- ZeRO 1-3: FSDP2 ``fully_shard`` on every block copy and then on the root (``shard``), over the ``dp`` mesh
  dimension (2-D DTensors where tensor parallelism shards them too), with the precision's mixed-precision
  policy (``precision.fsdp_kwargs``):
  - ZeRO 1: optimizer states sharded; parameters kept gathered and gradients accumulated whole over the
    micro-batches, reduce-scattered once on the last one, which also frees the gathered parameters: one
    reduce-scatter and one all-gather a step, an all-reduce's volume (``fsdp_micro_batch``; in a pipeline the
    same hook is told before each of a stage's backwards whether it is the stage's last of the step);
  - ZeRO 2: gradients sharded too, reduce-scattered after every micro-batch's backward (deferring would hold
    unsharded gradients); the parameters stay gathered until the last micro-batch's backward (a stage's last);
  - ZeRO 3: parameters sharded as well: FSDP2's defaults, gathered and freed around every use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from ...space.plan import Plan
from ..blocks import block_modules
from ..engines.precision import fsdp_kwargs
from ..engines.precision_names import of_plan

MicroBatchHook = Callable[[bool], None]      # told before each micro-batch whether it is the step's last


def shard(module: nn.Module, plan: Plan, dp_mesh, root: nn.Module | None = None) -> None:
    """ZeRO 1-3 (module doc): FSDP2 on every block copy of ``module``, then on ``root`` (``module`` itself unless
    another wraps it, a pipeline's relay), over ``dp_mesh``; reshard after forward under ZeRO 3 only."""
    reshard, precision = plan.zero == 3, fsdp_kwargs(of_plan(plan), plan.grad_dtype)
    for name in block_modules(module, plan):
        fully_shard(module.get_submodule(name), mesh=dp_mesh, reshard_after_forward=reshard, **precision)
    fully_shard(module if root is None else root, mesh=dp_mesh, reshard_after_forward=reshard, **precision)


def fsdp_micro_batch(model: nn.Module, zero: int) -> MicroBatchHook | None:
    """What FSDP2 is told before each micro-batch (``before_micro_batch(last)``), so that it communicates as the
    cost model prices the ZeRO stage (module doc): ZeRO 1 syncs gradients and reshards on the last micro-batch
    only (``set_requires_gradient_sync``), ZeRO 2 reduce-scatters every micro-batch and reshards on the last,
    ZeRO 3 keeps FSDP2's defaults (None)."""
    if zero == 3:
        return None

    def before_micro_batch(last: bool) -> None:
        model.set_reshard_after_backward(last)
        if zero == 1:
            model.set_requires_gradient_sync(last)
    return before_micro_batch


def replicate(module: nn.Module, device: torch.device, process_group=None) -> nn.parallel.DistributedDataParallel:
    """ZeRO 0 (module doc): DDP over ``process_group`` (default: every rank) with gradients as bucket views."""
    return nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                               process_group=process_group, gradient_as_bucket_view=True)


def ddp_micro_batch(ddp: nn.parallel.DistributedDataParallel) -> MicroBatchHook:
    """DDP all-reduces on the step's last micro-batch only (gradients accumulate locally before it)."""
    def before_micro_batch(last: bool) -> None:
        ddp.require_backward_grad_sync = last
    return before_micro_batch


def data_parallel_stage(stage_module: nn.Module, plan: Plan, dp_mesh) -> MicroBatchHook | None:
    """ZeRO 1-3 for a pipeline stage (module doc): FSDP2 on its block copies and on the stage module, its root, as on
    the whole model; returns what FSDP2 is told before each of the stage's backwards (``fsdp_micro_batch``: whether
    it is the stage's last of the step), which ``pipeline_executor`` calls. ZeRO 0 stages get DDP after placement
    (``replicate``), as the whole model does."""
    if plan.zero == 0:
        return None
    shard(stage_module, plan, dp_mesh)
    return fsdp_micro_batch(stage_module, plan.zero)


__all__ = ["MicroBatchHook", "data_parallel_stage", "ddp_micro_batch", "fsdp_micro_batch", "replicate", "shard"]
