"""Gradients that are partial sums over a tensor-parallel group, summed once per step in one bucket.

Under sequence parallelism the parameters outside a copy's branches (the norms' weights and biases) are ``Replicate``
DTensors that meet the sequence-sharded stream (``runtime.parallel.sequence_parallel``), so the gradient each rank
computes is its share of the tokens' sum: a ``Partial`` DTensor. (The row linears' biases are ``Replicate`` too, but
their gradients come out whole: DTensor computes them from the output gradient gathered back from the reduce-scatter.)
Left so, every optimizer op that reads a partial gradient redistributes it (``torch.distributed.tensor``: an
all-reduce each time a ``Partial`` operand meets a ``Replicate`` one): AdamW's per-tensor loop reads it three times
(``exp_avg.lerp_``, and ``exp_avg_sq.addcmul_`` with it as both factors), three all-reduces of each norm parameter
every step (48 in a 4-layer GPT's step over tp2, 16 norm parameters; measured with ``CommDebugMode``).
Megatron-LM sums them once a step over the tensor-parallel group, in one bucket (``finalize_model_grads``: the
sequence-parallel layers' layernorm gradients flattened and all-reduced together). Here an optimizer step pre-hook
does the same (``reduce_before_step``): before each step, the gradients that are sums pending over a 1-D mesh are
flattened into one buffer per (mesh, dtype, device), all-reduced once, and handed back as ``Replicate`` DTensors
viewing that buffer, so the optimizer issues no collective for them.

Only parameters that are ``Replicate`` DTensors on a 1-D mesh can get such gradients, so the hook is registered only
where there are some: under FSDP2 (ZeRO 1-3 over a ``(dp, tp)`` mesh) they are 2-D DTensors, and FSDP2 sums their
``Partial`` tensor-parallel dim itself before its reduce-scatter (``FSDPParam._get_grad_inner_tensor``: one
all-reduce per such parameter at each reduce-scatter), so its optimizer sees no partial gradient and gets no hook.
Summing a gradient over its mesh is what DTensor would do. Over two ranks each element is one addition, the same
whatever the bucket (``tests/test_sequence_parallel.py``: the parameters after two steps are bitwise those of DTensor's
sums); over more, a ring all-reduce may add an element's terms in another order in another bucket (a last-bit
difference).
"""

from __future__ import annotations

import torch


def _replicated_on_one_dim(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Replicate
    return isinstance(param, DTensor) and param.device_mesh.ndim == 1 and isinstance(param.placements[0], Replicate)


def _pending_sum(grad) -> bool:
    from torch.distributed.tensor import DTensor, Partial
    return isinstance(grad, DTensor) and grad.device_mesh.ndim == 1 and isinstance(grad.placements[0], Partial) \
        and grad.placements[0].reduce_op == "sum"


def reduce_partial_gradients(params: list[torch.nn.Parameter]) -> int:
    """Sum, over its mesh, every gradient of ``params`` that is a ``Partial`` sum on a 1-D mesh: one all-reduce per
    (mesh, dtype, device) of all of them flattened; each becomes a ``Replicate`` DTensor. Returns the all-reduces
    issued."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate
    buckets: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in params:
        if _pending_sum(p.grad):
            buckets.setdefault((p.grad.device_mesh, p.grad.dtype, p.grad.device), []).append(p)
    for (mesh, _, _), bucket in buckets.items():
        parts = [p.grad._local_tensor for p in bucket]
        flat = torch.cat([t.reshape(-1) for t in parts])
        dist.all_reduce(flat, group=mesh.get_group())
        for p, part, summed in zip(bucket, parts, flat.split([t.numel() for t in parts])):
            p.grad = DTensor.from_local(summed.view(part.shape), mesh, [Replicate()], run_check=False)
    return len(buckets)


def reduce_before_step(optimizer: torch.optim.Optimizer) -> bool:
    """Register ``reduce_partial_gradients`` as ``optimizer``'s step pre-hook, for the parameters that can get
    partial gradients (module doc); whether there are any."""
    params = [p for group in optimizer.param_groups for p in group["params"] if _replicated_on_one_dim(p)]
    def before_step(_optimizer, _args, _kwargs) -> None:
        reduce_partial_gradients(params)
    if params:
        optimizer.register_step_pre_hook(before_step)
    return bool(params)


__all__ = ["reduce_before_step", "reduce_partial_gradients"]
