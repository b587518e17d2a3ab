"""The torch-native engine: recomputation through checkpoint wrappers (full: torch's checkpoint; selective:
the attention core only, ``selective``), data parallelism as DDP
(ZeRO 0) or FSDP2 ``fully_shard`` (ZeRO 1: optimizer states sharded, parameters kept gathered and gradients
accumulated whole, reduce-scattered once per step; ZeRO 2: gradients sharded too, reduce-scattered every
micro-batch; ZeRO 3: parameters too), tensor parallelism with ``torch.distributed.tensor`` and pipeline
stages with ``torch.distributed.pipelining``."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

import torch
from torch import nn

from ..errors import TensorOptError
from .device import check_placement, init_process_group
from .materialize import Materializer
from .param_groups import build_optimizer
from .precision import autocast_forward, cast_model, fsdp_kwargs, of_plan
from .run import Run, plain_stepper
from .vocab_parallel import loss_context


def block_modules(model: nn.Module, plan: dict) -> list[str]:
    """Module names of every copy of the plan's blocks, in model order (``layers.*`` -> layers.0...)."""
    names = [n for n, _ in model.named_modules()]
    out = []
    for block in plan["blocks"]:
        pattern = block["block"]
        out += [n for n in names if fnmatch.fnmatchcase(n, pattern) and n.count(".") == pattern.count(".")]
    return out


def largest_block_bytes(model: nn.Module, plan: dict) -> int:
    """Bytes of the parameters and buffers of the plan's largest block copy (on meta too: no memory read)."""
    sizes = [sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))
             for m in map(model.get_submodule, block_modules(model, plan))]
    return max(sizes, default=0)


def recomputed_modules(model: nn.Module, plan: dict, kind: str = "full") -> list[str]:
    """The block copies the plan recomputes as ``kind`` says (full or selective): on each pipeline stage,
    the stage's first copies of each block, as many as its strategies say (strategies carry copy counts per
    stage). With virtual stages a device's copies are its stages' shares (stages r, r + pp, ...), in order."""
    out = []
    stages = plan["pp"] * plan.get("virtual_stages", 1)
    for block in plan["blocks"]:
        copies = block_modules(model, {"blocks": [block]})
        per_stage = [s["recompute"] for s in block["strategies"] for _ in range(s["copies"])]
        size = max(len(copies) // stages, 1)        # copies per (virtual) stage
        for i, name in enumerate(copies):
            stage, offset = divmod(i, size)
            position = (stage // plan["pp"]) * size + offset   # among its device's copies
            if position < len(per_stage) and per_stage[position] == kind:
                out.append(name)
    return out


def replace_module(model: nn.Module, name: str, wrap) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, wrap(getattr(parent, child)))


def recompute_wrappers(model: nn.Module, plan: dict) -> dict[str, object]:
    """{block copy: the wrapper that recomputes it}: ``checkpoint_wrapper`` for full recomputation, the
    selective one (``runtime.selective``: the attention core only) for selective."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from .selective import selective_wrapper
    return {**{name: checkpoint_wrapper for name in recomputed_modules(model, plan, "full")},
            **{name: selective_wrapper for name in recomputed_modules(model, plan, "selective")}}


def apply_recompute(model: nn.Module, plan: dict) -> None:
    for name, wrap in recompute_wrappers(model, plan).items():
        replace_module(model, name, wrap)


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
        from .pipeline import apply_pipeline
        return apply_pipeline(model, optimizer_fn, plan, device, materializer, example_inputs)
    dp, tp = plan["dp"], plan["tp"]
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp")) if tp > 1 or plan["zero"] >= 1 \
        else None
    vocab_split = False             # the logits sharded by vocabulary: the loss runs under loss_parallel
    if tp > 1:
        from .tensor_parallel import apply_tensor_parallel
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


def place(module: nn.Module, device: torch.device, materializer: Materializer | None) -> None:
    """Put ``module`` (already sharded, if the plan shards it) on ``device``: a meta-built one gets storage
    for this rank's part and the model's own initialisation, a real one is moved (only its shards, where
    FSDP2 or tensor parallelism already split it). Stops with one line if anything stays elsewhere."""
    if materializer is not None:
        materializer.materialize(module, device)
    else:
        module.to(device)
    check_placement(module, device, "tensoropt.parallelize")
