"""Data parallelism for the torch engine, with the model whole (``torch_engine``) or cut into pipeline stages
(``pipeline``): one function per case, both engines' paths calling the same ones.

The plan's ZeRO stage says what each data-parallel rank holds (Rajbhandari et al., SC'20), and each stage runs
with torch's own wrappers so that it communicates as ``cost.model`` prices it:

- ZeRO 0: DDP (``replicate``); gradients live in DDP's buckets (``gradient_as_bucket_view``), not in a second
  copy: one gradient's memory, as planned. It all-reduces on the last micro-batch's backward only
  (``ddp_micro_batch``; a pipeline stage does the same itself for a DDP module).
- ZeRO 1-3: FSDP2 ``fully_shard`` on every block copy and then on the root (``shard``), over the ``dp`` mesh
  dimension (2-D DTensors where tensor parallelism shards them too), with the precision's mixed-precision
  policy (``precision.fsdp_kwargs``):
  - ZeRO 1: optimizer states sharded; parameters kept gathered and gradients accumulated whole over the
    micro-batches, reduce-scattered once on the last one, which also frees the gathered parameters: one
    reduce-scatter and one all-gather a step, an all-reduce's volume (``fsdp_micro_batch``; in a pipeline the
    relay is FSDP2's root, so ``PipelineStage`` defers the reduce-scatter to its last backward the same way);
  - ZeRO 2: gradients sharded too, reduce-scattered after every micro-batch's backward (deferring would hold
    unsharded gradients); the parameters stay gathered until the step ends (in a pipeline, the block copies and
    the stage module are FSDP2's units inside the relay, so the stage does not defer their reduce-scatter, and
    ``reshard_all`` frees the parameters once the schedule is done);
  - ZeRO 3: parameters sharded as well: FSDP2's defaults, gathered and freed around every use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..space.plan import Plan
from .blocks import block_modules
from .pipeline_split import Relay
from .precision import fsdp_kwargs, of_plan

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


def data_parallel_stage(relay: Relay, plan: Plan, dp_mesh, device: torch.device) -> nn.Module:
    """A pipeline stage wrapped for data parallelism over ``dp_mesh``, as ``PipelineStage`` expects it: DDP around
    the relay under ZeRO 0 (the stage recognises it and syncs on the last backward only); under ZeRO 1 FSDP2 with
    the relay as root (the stage defers the reduce-scatter, and the freeing of the gathered parameters, to its
    last backward: ``PipelineStage.perform_reduce_grad``); under ZeRO 2/3 FSDP2 on the
    block copies and the stage module inside the relay, so that FSDP2 runs its own hooks on every micro-batch (a
    root ``FSDPModule`` would be told by the stage to defer its reduce-scatter: unsharded gradients, not what
    ZeRO 2/3 is priced as); under ZeRO 2 the parameters stay gathered after each backward (``reshard_all``)."""
    stage_module = relay.stage
    if plan.zero >= 1:
        shard(stage_module, plan, dp_mesh, root=relay if plan.zero == 1 else None)
        if plan.zero == 2:
            stage_module.set_reshard_after_backward(False)
        return relay
    if plan.dp > 1:
        return replicate(relay, device, dp_mesh.get_group())
    return relay


def reshard_all(modules: list[nn.Module]) -> Callable[[], None]:
    """Free the gathered parameters of every FSDP2 module in ``modules`` (ZeRO 2 keeps them through the
    micro-batches): the next step gathers the updated shards again."""
    fsdp = [m for module in modules for m in module.modules() if isinstance(m, FSDPModule)]

    def reshard() -> None:
        for module in fsdp:
            module.reshard()
    return reshard


__all__ = ["MicroBatchHook", "data_parallel_stage", "ddp_micro_batch", "fsdp_micro_batch", "replicate",
           "reshard_all", "shard"]
