"""The torch-native engine: applies a plan with torch's own parallelism, one module per concern, each
imported from here and none importing this one back:

- ``blocks``: which modules are the plan's block copies (every concern below acts per copy);
- ``engines.precision``: the weights' dtype, autocast and FSDP2's mixed-precision policy (``--precision``);
- ``parallel.tensor_parallel`` (with ``tp_styles``, ``tp_guard``, ``sequence_parallel``, ``vocab_parallel``):
  Megatron-LM's layout with ``torch.distributed.tensor``, the sequence split between branches, the
  vocabulary-parallel embedding, head and loss;
- ``memory.recompute``: full (``checkpoint_wrapper``) or selective (``memory.selective``) recomputation per copy;
- ``engines.compile``: ``torch.compile`` per copy (``--compile``), after the two above and before data parallelism;
- ``parallel.context_parallel``: the sequence split over cp ranks (a (dp, cp, tp) mesh), keys and values gathered;
- ``parallel.expert_parallel``: the experts of Hugging Face MoE layers sharded over ep ranks taken from dp (an
  (edp, ep, tp) mesh, dp = edp x ep), after tensor parallelism (whose guard runs the blocks whole) and before
  recomputation; their data parallelism is over the edp ranks only (FSDP2 on each experts module before the blocks,
  or DDP without them and their gradients reduced before the optimizer step);
- ``parallel.data_parallel``: DDP (ZeRO 0) or FSDP2 ``fully_shard`` per copy (ZeRO 1-3), the same functions for
  the whole model and for pipeline stages (over the dp x cp ranks under context parallelism);
- ``memory.materialize``: placement, a meta-built model given storage for this rank's part only;
- ``pipeline.stages`` (with ``pipeline.split``, ``pipeline.tp``): stages with ``torch.distributed.pipelining``,
  which applies the concerns above inside each stage.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import TensorOptError
from ...space.run_plan import RunPlan
from ..blocks import check_copies, largest_block_bytes
from ..device import init_process_group
from ..memory.materialize import Materializer, place
from ..memory.recompute import apply_recompute
from ..parallel import expert_parallel
from ..parallel.context_parallel import install as install_context_parallel
from ..parallel.data_parallel import ddp_micro_batch, fsdp_micro_batch, replicate, shard
from ..parallel.tensor_parallel import apply_tensor_parallel
from ..parallel.vocab_parallel import loss_context
from ..pipeline.stages import apply_pipeline
from ..run import Run, plain_stepper
from .compile import apply_compile
from .param_groups import build_optimizer
from .precision import autocast_forward, cast_model
from .precision_names import of_plan


def apply(model: nn.Module, optimizer_fn, run_plan: RunPlan, device: torch.device,
          materializer: Materializer | None = None, example_inputs=None) -> tuple[nn.Module, object, Run]:
    """Apply ``run_plan`` to ``model`` on ``device``: shard it (on the meta device if it was built there), then
    give this rank's part storage on the device, then wrap it for data parallelism."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    init_process_group(device)
    plan = run_plan.plan
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != plan.devices:
        raise TensorOptError(f"plan {plan.summary()} is for {plan.devices} devices but {world} workers were "
                             "started")
    check_copies(model, plan, "torch")      # every copy-wise step below finds the copies the plan was priced for
    if materializer is not None:      # an init_fn call wider than a block copy is said (see materialize)
        materializer.block_bytes = largest_block_bytes(model, plan)
    precision = of_plan(plan)
    cast_model(model, precision)      # before sharding: the weights' dtype (see runtime.engines.precision)
    if plan.ep > 1:
        expert_parallel.check_plan(plan, "torch", model)
    if plan.pp > 1:
        return apply_pipeline(model, optimizer_fn, run_plan, device, materializer, example_inputs)
    dp, tp = plan.dp, plan.tp
    if plan.cp > 1:                 # (dp, cp, tp): data parallelism over the dp x cp ranks (context_parallel)
        mesh = init_device_mesh(device.type, (dp, plan.cp, tp), mesh_dim_names=("dp", "cp", "tp"))
        dp_mesh = mesh["dp", "cp"]._flatten("dp_cp")
    elif plan.ep > 1:               # (edp, ep, tp): an ep group is ep consecutive dp ranks (expert_parallel)
        mesh = init_device_mesh(device.type, (dp // plan.ep, plan.ep, tp), mesh_dim_names=("edp", "ep", "tp"))
        dp_mesh = mesh["edp", "ep"]._flatten("dp")
    else:
        mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp")) if tp > 1 or plan.zero >= 1 \
            else None
        dp_mesh = mesh["dp"] if mesh is not None else None
    vocab_split = False             # the logits sharded by vocabulary: the loss runs under loss_parallel
    if tp > 1:
        vocab_split = apply_tensor_parallel(model, run_plan, mesh["tp"], device, example_inputs)
    experts = expert_parallel.shard_experts(model, plan, mesh["ep"]) if plan.ep > 1 else []
    apply_recompute(model, plan)
    apply_compile(model, plan)      # around TP and recomputation, inside DDP / FSDP2 (see runtime.engines.compile)
    autocast_forward(model, precision, device)
    before_micro_batch = None
    if plan.zero >= 1:
        if experts:                 # inner units first: the blocks' and the root's FSDP2 then leave them alone
            expert_parallel.shard_experts_fsdp(experts, plan, mesh["edp"])
        shard(model, plan, dp_mesh)
        before_micro_batch = fsdp_micro_batch(model, plan.zero)
    place(model, device, materializer)
    if plan.zero == 0 and dp * plan.cp > 1:      # every rank: ZeRO 0 runs no tp beside dp or cp (search.engines)
        if experts:
            expert_parallel.ignore_in_ddp(model, experts)
        model = replicate(model, device)
        before_micro_batch = ddp_micro_batch(model)
    optimizer = build_optimizer(optimizer_fn, model.parameters())
    if experts and plan.zero == 0 and optimizer is not None:
        expert_parallel.reduce_before_step(optimizer, experts, mesh["edp"].get_group(), dp)
    dp_rank = rank // (plan.cp * tp)
    losses = loss_context(vocab_split, run_plan.lean_loss)
    stepper = plain_stepper(model, optimizer, before_micro_batch, loss_context=losses) if optimizer else None
    run = Run(rank, world, dp_rank, dp, plan.micro_batch, plan.grad_accumulation, plan.global_batch, run_plan,
              "torch", stepper, device=device)
    if plan.cp > 1:                 # after tensor parallelism's guard, which runs the model on whole sequences
        run.context = (plan.cp, mesh.get_local_rank("cp"), sequence_length(example_inputs))
        install_context_parallel(mesh["cp"].get_group(), *run.context)
    return model, optimizer, run


def sequence_length(example_inputs) -> int:
    """The sequence a context-parallel plan splits: dim 1 of the example batch's token ids."""
    from ...models import example_shape
    seq = example_shape(example_inputs)[1] if example_inputs is not None else None
    if not seq:
        raise TensorOptError("context parallelism splits the sequence of tensoropt.parallelize's example_inputs: pass "
                             "example_inputs with token ids of shape (batch, sequence)")
    return seq


__all__ = ["apply"]
