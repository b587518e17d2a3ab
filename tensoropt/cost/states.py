"""Bytes per parameter of the model states a plan holds, by precision and engine (sizes before ZeRO divides them
over dp; ``cost.model`` divides them).

Named precisions (the plan's ``precision``, ``tensoropt launch --precision``; ``state_bytes``), bytes per
parameter as each engine holds them, before ZeRO divides them over dp (``cost.model``):
- ``32-true``: 4 + 4 + 8 (AdamW's two float32 moments, Loshchilov & Hutter 2019), every engine.
- ``bf16-true``: 2 + 2 + 4 (torch: the model cast to bf16; DeepSpeed: ``bf16_master_weights_and_grads`` and
  ``bf16_optimizer_states``, its ZeRO 1-2 partition a bf16 copy, 2/dp).
- ``bf16-mixed`` on DeepSpeed (``master_weights``): 2 + 2 + 12, ZeRO's K = 12 (Rajbhandari et al. 2020,
  sec. 3.1): bf16 weights and gradients, float32 master weights and two moments (``BF16_Optimizer``, ZeRO's
  float32 partitions); gradients accumulated in bf16 (``data_types.grad_accum_dtype``), so no float32 copy.
- ``bf16-mixed`` on the torch engine (``torch_mixed``): the weights themselves are float32. Without FSDP2:
  4 + 4 + 8, plus autocast's bf16 copy of every weight (2, kept for the step: autocast caches the casts of
  leaf float32 tensors that need gradients, and the products save them for backward; torch.amp docs). With
  FSDP2 (torch ``fully_shard`` docs, ``MixedPrecisionPolicy``: parameters gathered in ``param_dtype``,
  gradients reduced in ``reduce_dtype``, sharded parameters kept in their own dtype): ZeRO 3 holds float32
  shards 4/dp, float32 gradient shards 4/dp, AdamW 8/dp, gathers in bf16 (2 bytes communicated; the
  gathered units and gradient buffers FSDP2 holds beyond the shards are priced in ``cost.torch_memory``)
  and reduce-scatters float32 (4); ZeRO 2 (``reshard_after_forward=False``) keeps the gathered bf16 weights
  through the step (2, whole) beside the float32 shard (4/dp); ZeRO 1 too, and accumulates whole float32
  gradients (4) over the micro-batches, reduce-scattered once after the last
  (``set_requires_gradient_sync``). Autocast over FSDP2's bf16 weights casts nothing, so it caches no copy.
- ``bf16-mixed`` on the torch engine with bf16 gradients (the plan's ``grad_dtype``, ZeRO 1-3 only: FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``). FSDP2 clamps a ``reduce_dtype`` equal to
  ``param_dtype`` to None (``FSDPParam.init_dtype_attrs``), so ``to_accumulated_grad_if_needed`` makes no float32
  copy: under ZeRO 1 autograd accumulates the micro-batches' unsharded gradients in bf16 on the gathered bf16
  weights (2, whole), and ``foreach_reduce`` (``_fsdp_collectives.py``) copies each unit's into a bf16
  reduce-scatter input, reduce-scatters it in bf16 (2 bytes communicated) and casts the output shard to the
  float32 parameters' dtype (``_to_dtype_if_needed(reduce_output, orig_dtype)``), where ZeRO 2-3 accumulate the
  micro-batches' shards (4/dp, as with float32 reductions). ZeRO 1: 2 + 2 + 12/dp instead of 2 + 4 + 12/dp (the
  reference footprint of Megatron-LM's distributed optimizer with bf16 gradients, ``--grad-reduce-in-bf16``,
  against its default ``--accumulate-allreduce-grads-in-fp32``); ZeRO 2-3 hold what they held and communicate
  half the gradient bytes. ``StateBytes.reduce`` is the reduced dtype's width, ``grad`` what is held.
Compute and activations come from the graph's op dtypes: the launcher captures the script in the precision it
plans (``launcher.capture``), so bf16 plans compute at the bf16 peak and save bf16 activations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of the model states under one ZeRO stage, and bytes one fused Adam step moves per
    parameter (see the module docstring for each precision and engine)."""

    weight: int                  # the weights held: whole under ZeRO 0-2, divided over dp under ZeRO 3
    grad: int                    # the gradients held and reduced (divided over dp under ZeRO 2-3)
    optimizer: int
    adam_moved: int
    partition_copy: int = 0      # a separate master partition when only the optimizer is sharded (ZeRO 1-2)
    precision: str = ""          # what was assumed, in words (plan files and ``estimate`` say it)
    gathered: int = 0            # bytes of the weights ZeRO 2-3 gather and compute with, when not ``weight``
    cast_copy: int | None = None  # autocast's 16-bit copy of float32 weights held for the step; None: as captured
    reduce: int = 0              # bytes per gradient element reduced over dp (and of FSDP2's reduce-scatter input),
    #                              when not ``grad`` (bf16 reductions into float32 shards)

    def optimizer_bytes(self, zero: int) -> int:
        """Optimizer-state bytes per parameter (before dividing over dp) under a ZeRO stage."""
        return self.optimizer + (self.partition_copy if zero in (1, 2) else 0)

    @property
    def gathered_bytes(self) -> int:
        return self.gathered or self.weight

    @property
    def reduced_bytes(self) -> int:
        return self.reduce or self.grad


# mixed precision (Micikevicius et al. 2018; Rajbhandari et al. 2020: 2 + 2 + K, K = 12); Adam step:
# read/write fp32 master, m, v; read grad; write bf16
MIXED_PRECISION = StateBytes(weight=2, grad=2, optimizer=12, adam_moved=36, precision="mixed precision: 16-bit "
                             "weights and gradients, float32 master weights and AdamW states (2 + 2 + 12 bytes)")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def own_dtype(dtype: str) -> StateBytes:
    """Training in the weights' own dtype of b bytes: b + b + 2b (AdamW's two moments in that dtype); a fused
    step reads weight, gradient, m, v and writes weight, m, v: 7b bytes."""
    b = DTYPE_BYTES.get(dtype, 2)
    return StateBytes(weight=b, grad=b, optimizer=2 * b, adam_moved=7 * b, partition_copy=b,
                      precision=f"{dtype} weights, gradients and AdamW states, no master copy ({b} + {b} + {2 * b} "
                                "bytes)")


def torch_mixed(zero: int, grad_dtype: str = "") -> StateBytes:
    """bf16-mixed in the torch engine: the weights stay float32 and are the master copy. ZeRO 0 (DDP, tensor
    parallel, one process, pipeline stages): 4 + 4 + 8, and autocast's bf16 copy of every weight, cached for
    the step (2). ZeRO 1-3 (FSDP2, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)``): the
    float32 shards (4/dp) are the master; a unit's weights are gathered in bf16 (2) and its gradients reduced
    in float32. ZeRO 1 and 2 keep the gathered bf16 weights through the step (2, whole) beside the float32
    shard (4/dp, counted as ``partition_copy``). ZeRO 2-3 keep float32 gradient shards (4/dp); ZeRO 1 skips
    the reduce-scatter until the last micro-batch, and FSDP2 then accumulates each unsharded bf16 gradient
    into a float32 one (``FSDPParam.to_accumulated_grad_if_needed``: reduce_dtype differs from param_dtype):
    4, whole (one accumulation step reduce-scatters the bf16 gradient at once, less than priced). The step is
    ``torch.optim.AdamW``'s default on GPUs, the foreach implementation (``torch/optim/adam.py``
    ``_multi_tensor_adam``), eight passes over float32 lists rather than one fused kernel: decay (read and write
    the weight, 8 bytes), lerp of m (12), scale of v (8), addcmul into v (12), sqrt of v into a temporary (8),
    two in-place passes on it (16), addcdiv into the weight (16): 80 bytes per parameter. ``grad_dtype``
    "bfloat16" (ZeRO 1-3): gradients reduced in bf16, and under ZeRO 1 accumulated whole in bf16 (module doc)."""
    words = "float32 weights, gradients and AdamW states, bf16 compute"
    if zero >= 1 and grad_dtype == "bfloat16":
        return StateBytes(weight=4 if zero == 3 else 2, grad=2 if zero == 1 else 4, optimizer=8, adam_moved=80,
                          partition_copy=4, gathered=2, cast_copy=0, reduce=2,
                          precision="float32 weights and AdamW states, bf16 compute and gradients (FSDP2 gathers "
                          "bf16 weights, " + ("accumulates and reduces bf16 gradients; 2 + 2 + 12 bytes, the 12 "
                                              "sharded)" if zero == 1 else "reduces bf16 gradients into float32 "
                                              "shards; 4 + 4 + 8 bytes sharded)"))
    if zero >= 1:
        return StateBytes(weight=4 if zero == 3 else 2, grad=4, optimizer=8, adam_moved=80, partition_copy=4,
                          gathered=2, cast_copy=0, precision=words + " (FSDP2 gathers bf16 weights, reduces "
                          "float32 gradients; 4 + 4 + 8 bytes sharded)")
    return StateBytes(weight=4, grad=4, optimizer=8, adam_moved=80, partition_copy=4, cast_copy=2,
                      precision=words + " under autocast (4 + 4 + 8 bytes, + 2 for autocast's bf16 weight copies)")


def state_bytes(dtype: str, master_weights: bool = True, precision: str = "", zero: int = 0,
                grad_dtype: str = "") -> StateBytes:
    """Model-state sizes for a plan's training precision under ZeRO stage ``zero`` (module docstring).

    ``precision`` "" (plans from before it was named): 16-bit types with a float32 master copy train in mixed
    precision; float32, or any dtype without a master copy, trains the weights themselves. ``bf16-mixed`` with
    ``master_weights`` is DeepSpeed's bf16 mode (2 + 2 + 12); without, the torch engine's (``torch_mixed``).
    ``bf16-true`` is 2 + 2 + 4 and ``32-true`` 4 + 4 + 8 in every engine. ``grad_dtype`` (the plan's): "bfloat16"
    changes the torch engine's bf16-mixed ZeRO 1-3 only; DeepSpeed's bf16 mode accumulates in bf16 already."""
    if precision == "bf16-mixed" and not master_weights:
        return torch_mixed(zero, grad_dtype)
    if precision:        # the engine casts the weights to what it trains: no autocast copy of them is kept
        named = {"32-true": own_dtype("float32"), "bf16-true": own_dtype("bfloat16")}.get(precision, MIXED_PRECISION)
        return dataclasses.replace(named, cast_copy=0)
    return MIXED_PRECISION if master_weights and DTYPE_BYTES.get(dtype, 2) < 4 else own_dtype(dtype)


def checkpoint_bytes(dtype: str, master_weights: bool = True, precision: str = "", zero: int = 0,
                     grad_dtype: str = "") -> int:
    """Bytes per parameter a checkpoint of the model states holds, whatever the plan shards (a checkpoint holds each
    state once, across all ranks): the weights the optimizer steps and its states, no gradients. The torch
    engine's bf16-mixed steps its float32 weights (4 + AdamW's 8); 32-true 4 + 8, bf16-true 2 + 4; DeepSpeed's bf16
    mode its bf16 weights beside the float32 master and moments (2 + 12)."""
    held = state_bytes(dtype, master_weights, precision, zero, grad_dtype)
    weights = 4 if precision == "bf16-mixed" and not master_weights else DTYPE_BYTES.get(dtype, 2)
    return weights + held.optimizer


__all__ = ["DTYPE_BYTES", "MIXED_PRECISION", "StateBytes", "checkpoint_bytes", "own_dtype", "state_bytes",
           "torch_mixed"]
