"""The DeepSpeed engine: a plan becomes a real DeepSpeed config (ZeRO stage, micro-batch and
gradient accumulation, optimizer offload, activation checkpointing, precision) and ``deepspeed.initialize``.
Under ZeRO 3 the model reaches the device already cut into partitions (``partition``), never whole.

``deepspeed_config`` (``ds_config``) is pure so the launcher can write the exact config into the run directory,
where the user can read and reuse it; the workers then train with that file. The optimizer is the
script's own (``optimizer_fn``): a config-built AdamW would become DeepSpeed's FusedAdam, which
compiles a C++ op on first use (~95 s, see ENVIRONMENT.md), and would ignore the script's choice.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from torch import nn

from ...space.plan import Plan
from ...space.run_plan import RunPlan
from ..blocks import check_copies, largest_block_bytes
from ..device import check_placement, init_process_group
from ..memory.materialize import Materializer, place
from ..memory.recompute import recomputed_modules
from ..parallel.vocab_parallel import loss_context
from ..run import Run, call_model, loss_of, mean_over_group
from .ds_config import deepspeed_config
from .param_groups import build_optimizer
from .precision import autocast_forward
from .precision_names import of_plan


def parameter_count(model: nn.Module) -> int:
    """The model's parameters (a tied weight once), as the launcher counts them in the captured graph."""
    return sum(p.numel() for p in model.parameters())


def _checkpointed(forward, *args, **kwargs):
    from deepspeed import checkpointing
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpointing.checkpoint(forward, *args, **kwargs)


def apply_recompute(model: nn.Module, plan: Plan, config: dict) -> None:
    """Recompute the plan's block copies: in full with ``deepspeed.checkpointing``, selectively (the attention
    core only) with ``runtime.memory.selective``. The forward is replaced on the instance rather than wrapped in a new
    module, so parameter names (and checkpoints) stay as the script's model has them."""
    from deepspeed import checkpointing

    from ..memory.selective import selective_checkpoint
    names = recomputed_modules(model, plan)
    if names:
        checkpointing.configure(None, deepspeed_config=config)
    for name in names:
        module = model.get_submodule(name)
        module.forward = functools.partial(_checkpointed, module.forward)
    for name in recomputed_modules(model, plan, "selective"):
        module = model.get_submodule(name)
        module.forward = functools.partial(selective_checkpoint, module.forward)


def apply(model: nn.Module, optimizer_fn, run_plan: RunPlan, device: torch.device,
          materializer: Materializer | None = None) -> tuple[nn.Module, object, Run]:
    """``deepspeed.initialize`` on the model put on ``device``: whole for ZeRO 0-2 (DeepSpeed keeps every
    weight on every device there), cut into this rank's ZeRO 3 partitions as it gets storage (``partition``)."""
    import deepspeed
    import torch.distributed as dist

    init_process_group(device)
    skip_inference_all_reduce_op(deepspeed)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    plan, path = run_plan.plan, run_plan.deepspeed_config
    config = json.loads(Path(path).read_text()) if path else deepspeed_config(plan, parameter_count(model))
    check_copies(model, plan, "deepspeed")  # its recomputation finds the copies the plan was priced for
    if materializer is not None:      # an init_fn call wider than a block copy is said (see materialize)
        materializer.block_bytes = largest_block_bytes(model, plan)
    if named := of_plan(plan):        # the weights in the dtype DeepSpeed trains them in (bf16 mode: bf16)
        model.to(torch.float32 if named == "32-true" else torch.bfloat16)
    if plan.zero == 3:
        partition(model, device, config, materializer)
    else:
        place(model, device, materializer)
    apply_recompute(model, plan, config)
    autocast_forward(model, of_plan(plan), device)      # bf16-mixed: norms and losses in float32, as alone
    optimizer = build_optimizer(optimizer_fn, model.parameters())
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    run = Run(rank, world, rank, world, plan.micro_batch, plan.grad_accumulation, plan.global_batch,
              run_plan, "deepspeed", _stepper(engine, run_plan.lean_loss) if optimizer else None, device=device)
    return engine, ds_optimizer, run


def skip_inference_all_reduce_op(deepspeed) -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce when its comm backend starts.

    On the CPU accelerator DeepSpeed 0.19.8 builds that op (``deepspeed_shm_comm``, a gcc run of ~60 s on a
    machine's first DeepSpeed start, and again whenever another install of DeepSpeed shares the extension cache)
    for one caller only, ``inference_all_reduce`` of DeepSpeed's inference engine; training's collectives are
    torch.distributed's (gloo), which is what the plan is priced for. DeepSpeed's registry of compatible ops is
    one dict whose edits persist (``deepspeed.ops.__compatible_ops__``), and ``comm.torch.build_shm_op`` skips an
    op marked incompatible there. The CUDA accelerator has no such op: nothing changes on GPUs."""
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def partition(model: nn.Module, device: torch.device, config: dict, materializer: Materializer | None) -> None:
    """ZeRO 3: no rank ever holds the whole model. Module by module (children first), each parameter gets
    storage on ``device`` and is at once cut to this rank's partition by DeepSpeed (as ``deepspeed.zero.Init``
    does to a model built under it); buffers get storage whole. A meta-built parameter's storage is left
    uninitialised, and the ``Materializer`` then computes each tensor at full size a few at a time and delivers
    each rank its partition: the values of the script run alone. A parameter built for real is moved, and rank
    0's values are sent to every rank, as DeepSpeed converts a built model. At most one parameter is whole at
    once here, plus the materialiser's transient copies."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    from ..memory.init_trace import apply_order
    zero_init, made = deepspeed.zero.Init(config_dict_or_path=config), {}   # made: id as built -> ZeRO 3 param
    for module in apply_order(model):
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty_like(buffer, device=device) if buffer.is_meta \
                    else buffer.to(device)
        for name, param in module._parameters.items():
            if param is None or is_zero_param(param):
                continue
            if id(param) not in made:         # a tied weight is converted once and registered under every name
                made[id(param)] = _on_device(param, device)
                if param.is_meta:             # nothing to send: the partitions are filled below, alike everywhere
                    zero_init._convert_to_deepspeed_param(made[id(param)])
                    made[id(param)].partition()
                else:
                    zero_init._zero_init_param(made[id(param)])
            module._parameters[name] = made[id(param)]
    if materializer is not None:
        materializer.initialise(model, device)
    check_placement(model, device, "tensoropt.parallelize")


def _on_device(param: nn.Parameter, device: torch.device) -> nn.Parameter:
    """``param`` with storage on ``device``: a parameter built for real moved in place (as DeepSpeed moves it), a
    meta one replaced by a new parameter with uninitialised storage (a meta tensor's ``.data`` cannot take a real
    one), keeping the attributes set on it."""
    if not param.is_meta:
        param.data = param.data.to(device)
        return param
    moved = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
    moved.__dict__.update(param.__dict__)
    return moved


def _stepper(engine, lean_loss: bool):
    """DeepSpeed drives accumulation itself: ``backward`` scales each micro-batch's loss by 1 /
    gradient_accumulation_steps and ``step`` only updates at the accumulation boundary. ``lean_loss``: each
    micro-batch's forward and backward run the model's loss on the runtime's lean cross-entropy
    (``vocab_parallel.loss_context``), as the plan was priced."""
    lean = loss_context(False, lean_loss)

    def step(micro_batches) -> torch.Tensor:
        total = None
        for micro in micro_batches:
            with lean():
                loss = loss_of(call_model(engine, micro))
                engine.backward(loss)
            engine.step()
            part = loss.detach().float() / len(micro_batches)
            total = part if total is None else total + part
        return mean_over_group(total)
    return step
