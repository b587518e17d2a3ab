"""The torch-native engine: applies a plan with torch's own parallelism, one module per concern, each
imported from here and none importing this one back:

- ``blocks``: which modules are the plan's block copies (every concern below acts per copy);
- ``precision``: the weights' dtype, autocast and FSDP2's mixed-precision policy (``--precision``);
- ``tensor_parallel`` (with ``tp_styles``, ``tp_guard``, ``sequence_parallel``, ``vocab_parallel``):
  Megatron-LM's layout with ``torch.distributed.tensor``, the sequence split between branches, the
  vocabulary-parallel embedding, head and loss;
- ``recompute``: full (``checkpoint_wrapper``) or selective (``selective``) recomputation per copy;
- data parallelism here: DDP (ZeRO 0) or FSDP2 ``fully_shard`` per copy (ZeRO 1: optimizer states sharded,
  parameters kept gathered and gradients accumulated whole, reduce-scattered once per step; ZeRO 2:
  gradients sharded too, reduce-scattered every micro-batch; ZeRO 3: parameters too);
- ``materialize``: placement, a meta-built model given storage for this rank's part only;
- ``pipeline`` (with ``pipeline_split``, ``pipeline_tp``): stages with ``torch.distributed.pipelining``,
  which applies the concerns above inside each stage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..errors import TensorOptError
from .blocks import block_modules, largest_block_bytes
from .device import init_process_group
from .materialize import Materializer, place
from .param_groups import build_optimizer
from .pipeline import apply_pipeline
from .precision import autocast_forward, cast_model, fsdp_kwargs, of_plan
from .recompute import apply_recompute
from .run import Run, plain_stepper
from .tensor_parallel import apply_tensor_parallel
from .vocab_parallel import loss_context


def apply(model: nn.Module, optimizer_fn, plan: dict, device: torch.device, materializer: Materializer | None = None,
          example_inputs=None) -> tuple[nn.Module, object, Run]:
    """Apply ``plan`` to ``model`` on ``device``: shard it (on the meta device if it was built there), then
    give this rank's part storage on the device, then wrap it for data parallelism."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    init_process_group(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != plan["devices"]:
        raise TensorOptError(f"plan {plan['summary']} is for {plan['devices']} devices but {world} workers were "
                             "started")
    if materializer is not None:      # an init_fn call wider than a block copy is said (see materialize)
        materializer.block_bytes = largest_block_bytes(model, plan)
    precision = of_plan(plan)
    cast_model(model, precision)      # before sharding: the weights' dtype (see runtime.precision)
    if plan["pp"] > 1:
        return apply_pipeline(model, optimizer_fn, plan, device, materializer, example_inputs)
    dp, tp = plan["dp"], plan["tp"]
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp")) if tp > 1 or plan["zero"] >= 1 \
        else None
    vocab_split = False             # the logits sharded by vocabulary: the loss runs under loss_parallel
    if tp > 1:
        vocab_split = apply_tensor_parallel(model, plan, mesh["tp"], device, example_inputs)
    apply_recompute(model, plan)
    autocast_forward(model, precision, device)
    before_micro_batch = None
    if plan["zero"] >= 1:
        from torch.distributed.fsdp import fully_shard
        reshard = plan["zero"] == 3
        for name in block_modules(model, plan):
            fully_shard(model.get_submodule(name), mesh=mesh["dp"], reshard_after_forward=reshard,
                        **fsdp_kwargs(precision))
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard, **fsdp_kwargs(precision))
        before_micro_batch = fsdp_micro_batch(model, plan["zero"])
    place(model, device, materializer)
    if plan["zero"] == 0 and dp > 1:
        # gradients live in DDP's buckets, not in a second copy: 1x gradient memory, as planned
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                                    gradient_as_bucket_view=True)
        ddp = model

        def before_micro_batch(last: bool) -> None:
            ddp.require_backward_grad_sync = last
    optimizer = build_optimizer(optimizer_fn, model.parameters())
    dp_rank = rank // tp
    run = Run(rank, world, dp_rank, dp, plan["micro_batch"], plan["gradient_accumulation"], plan["global_batch"],
              plan, "torch", plain_stepper(model, optimizer, before_micro_batch, loss_context=loss_context(vocab_split))
              if optimizer else None, device=device)
    return model, optimizer, run


def fsdp_micro_batch(model: nn.Module, zero: int) -> Callable[[bool], None] | None:
    """What FSDP2 is told before each micro-batch (``before_micro_batch(last)``), so that it communicates as the
    cost model prices the ZeRO stage. ZeRO 1: parameters stay gathered and gradients accumulate unsharded
    (``set_requires_gradient_sync(False)``) until the last micro-batch, whose backward reduce-scatters them once
    and frees the gathered parameters: one reduce-scatter and one all-gather a step, an all-reduce's volume.
    ZeRO 2: every micro-batch reduce-scatters (deferring would hold unsharded gradients), the parameters stay
    gathered until the last. ZeRO 3: FSDP2's defaults (gather and free around every use); None."""
    if zero == 3:
        return None

    def before_micro_batch(last: bool) -> None:
        model.set_reshard_after_backward(last)
        if zero == 1:
            model.set_requires_gradient_sync(last)
    return before_micro_batch

