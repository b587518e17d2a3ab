"""The DeepSpeed config that runs a plan as planned: pure (a ``Plan`` in, a dict out), so that the launcher writes the
exact config into the run directory without importing DeepSpeed or torch, and the workers train with that file
(``deepspeed_engine``)."""

from __future__ import annotations

from ...cost.deepspeed_memory import bucket_sizes
from ...space.plan import Plan

NEVER_PRINT_STEPS = 2**31 - 1


def deepspeed_config(plan: Plan, parameters: int | None = None) -> dict:
    """The DeepSpeed config that runs ``plan`` as planned: the precision it was priced in
    (``precision``), no gradient clipping (the plan's step is a plain optimizer step), and for a model of
    ``parameters`` parameters the bucket sizes priced (``cost.deepspeed_memory.bucket_sizes``)."""
    zero: dict = {"stage": plan.zero} | bucket_sizes(plan.zero, parameters)
    if plan.offload:
        import torch  # here: the launcher writes configs without importing torch but for offload plans
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accumulation,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,      # the script's torch optimizer, not a DeepSpeed one
        "zero_force_ds_cpu_optimizer": False,       # offload with it too (DeepSpeedCPUAdam would compile)
        "steps_per_print": NEVER_PRINT_STEPS,
    } | precision(plan)
    if recomputes(plan):
        config["activation_checkpointing"] = {
            "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
            "synchronize_checkpoint_boundary": False}
    return config


def precision(plan: Plan) -> dict:
    """The config sections for the plan's precision (``runtime.engines.precision``), holding the bytes it was priced
    with (``cost.model.state_bytes``):

    - ``bf16-mixed``: DeepSpeed's bf16 mode: bf16 weights, gradients (``data_types.grad_accum_dtype``; float32
      accumulation would add a float32 gradient per parameter under ZeRO 1) and gradient communication, float32
      master weights and AdamW states (``BF16_Optimizer`` under ZeRO 0, ZeRO's float32 partitions under 1-3):
      2 + 2 + 12 bytes per parameter. No overflow check, which would skip steps the script run alone takes.
    - ``bf16-true``: the bf16 mode with ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``: the
      partitions DeepSpeed updates and the AdamW states are bf16 too (2 + 2 + 4; DeepSpeed has these under
      ZeRO 1-3 only, ``search.engines.unsupported`` refuses ZeRO 0).
    - ``32-true``: no section: DeepSpeed's float32 mode.
    A plan without a precision (older plan files): bf16-mixed for a bf16 model, float32 mode otherwise. Without
    the section DeepSpeed would run a bf16 model in its float32 mode: float32 gradients and communication,
    twice the bytes priced; float16 would need loss scaling, which no plan prices."""
    name = plan.precision or ("bf16-mixed" if plan.dtype == "bfloat16" else "32-true")
    if name == "32-true":
        return {}
    pure = name == "bf16-true"
    return {"bf16": {"enabled": True, "bf16_master_weights_and_grads": pure, "bf16_optimizer_states": pure,
                     "check_grad_overflow": False},
            "data_types": {"grad_accum_dtype": "bf16"}}


def recomputes(plan: Plan) -> bool:
    return any(s.recompute == "full" for bp in plan.blocks for s, _ in bp.strategies)


__all__ = ["deepspeed_config", "recomputes"]
