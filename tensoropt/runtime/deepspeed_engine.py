"""The DeepSpeed engine: a plan becomes a real DeepSpeed config (ZeRO stage, micro-batch and
gradient accumulation, optimizer offload, activation checkpointing) and ``deepspeed.initialize``.

``deepspeed_config`` is pure so the launcher can write the exact config into the run directory,
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

from .device import init_process_group
from .materialize import Materializer
from .param_groups import build_optimizer
from .run import Run, call_model, loss_of, mean_over_group
from .torch_engine import recomputed_modules

NEVER_PRINT_STEPS = 2**31 - 1


def deepspeed_config(plan: dict) -> dict:
    """The DeepSpeed config that runs ``plan`` (its JSON) as planned: no mixed precision (the model's
    own dtype, as the torch engine), no gradient clipping (the plan's step is a plain optimizer step)."""
    zero: dict = {"stage": plan["zero"]}
    if plan["offload"]:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_batch_size": plan["global_batch"],
        "train_micro_batch_size_per_gpu": plan["micro_batch"],
        "gradient_accumulation_steps": plan["gradient_accumulation"],
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,      # the script's torch optimizer, not a DeepSpeed one
        "zero_force_ds_cpu_optimizer": False,       # offload with it too (DeepSpeedCPUAdam would compile)
        "steps_per_print": NEVER_PRINT_STEPS,
    }
    if recomputes(plan):
        config["activation_checkpointing"] = {
            "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
            "synchronize_checkpoint_boundary": False}
    return config


def recomputes(plan: dict) -> bool:
    return any(s["recompute"] == "full" for b in plan["blocks"] for s in b["strategies"])


def _checkpointed(forward, *args, **kwargs):
    from deepspeed import checkpointing
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpointing.checkpoint(forward, *args, **kwargs)


def apply_recompute(model: nn.Module, plan: dict, config: dict) -> None:
    """Recompute the plan's block copies with ``deepspeed.checkpointing``. The forward is replaced on
    the instance rather than wrapped in a new module, so parameter names (and checkpoints) stay as
    the script's model has them."""
    from deepspeed import checkpointing
    names = recomputed_modules(model, plan)
    if names:
        checkpointing.configure(None, deepspeed_config=config)
    for name in names:
        module = model.get_submodule(name)
        module.forward = functools.partial(_checkpointed, module.forward)


def apply(model: nn.Module, optimizer_fn, plan: dict, device: torch.device,
          materializer: Materializer | None = None) -> tuple[nn.Module, object, Run]:
    """``deepspeed.initialize`` on the model put on ``device``. DeepSpeed shards (ZeRO 3) a model that is
    already whole on the device, so a meta-built model is materialised in full first: one full copy per
    device for a moment (``deepspeed.zero.Init`` shards at construction, which a built model is past)."""
    import deepspeed
    import torch.distributed as dist

    from .torch_engine import place
    init_process_group(device)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    path = plan.get("deepspeed_config")
    config = json.loads(Path(path).read_text()) if path else deepspeed_config(plan)
    place(model, device, materializer)
    apply_recompute(model, plan, config)
    optimizer = build_optimizer(optimizer_fn, model.parameters())
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    run = Run(rank, world, rank, world, plan["micro_batch"], plan["gradient_accumulation"], plan["global_batch"],
              plan, "deepspeed", _stepper(engine) if optimizer else None, device=device)
    return engine, ds_optimizer, run


def _stepper(engine):
    """DeepSpeed drives accumulation itself: ``backward`` scales each micro-batch's loss by 1 /
    gradient_accumulation_steps and ``step`` only updates at the accumulation boundary."""
    def step(micro_batches) -> float:
        total = None
        for micro in micro_batches:
            loss = loss_of(call_model(engine, micro))
            engine.backward(loss)
            engine.step()
            part = loss.detach().float() / len(micro_batches)
            total = part if total is None else total + part
        return mean_over_group(total)
    return step
