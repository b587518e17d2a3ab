"""Under torchrun on two CPU workers: the passes over the gradients the torch engine's data parallelism makes to sum
a step's micro-batches (``runtime.parallel.data_parallel``: DDP under ``no_sync`` but the last, FSDP2's ZeRO 1 with
gradient sync off but the last, ZeRO 3 reduce-scattering every micro-batch), recorded below autograd in a second
step: every in-place add into, and every widening copy of, a tensor shaped like a parameter (unsharded or the rank's
shard), with the bytes each reads and writes. Rank 0 writes them to the JSON file argv[1]."""

from __future__ import annotations

import torch
import torch.distributed as dist
from probe_output import write_from_rank_0
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime.engines.precision import autocast_forward
from tensoropt.runtime.parallel.data_parallel import ddp_micro_batch, fsdp_micro_batch, replicate, shard
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan

MICRO_BATCHES, BATCH, SEQ = 3, 3, 20      # 60 tokens a micro-batch: no activation shares a parameter's shape


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class GradientPasses(TorchDispatchMode):
    """In-place adds into, and widening copies of, tensors of the parameters' shapes: per micro-batch, per kind,
    [count, bytes read and written]."""

    def __init__(self, shapes: set) -> None:
        super().__init__()
        self.shapes, self.micro_batch, self.seen = shapes, 0, [{} for _ in range(MICRO_BATCHES)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = nbytes = None
        if func is torch.ops.aten.add_.Tensor and tuple(args[0].shape) in self.shapes:
            kind, nbytes = f"add_ {args[0].dtype} += {args[1].dtype}", 2 * args[0].nbytes + args[1].nbytes
        elif func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in self.shapes \
                and out.dtype.itemsize > args[0].dtype.itemsize:
            kind, nbytes = f"_to_copy {args[0].dtype} -> {out.dtype}", args[0].nbytes + out.nbytes
        if kind:
            entry = self.seen[self.micro_batch].setdefault(kind, [0, 0])
            entry[0], entry[1] = entry[0] + 1, entry[1] + nbytes
        return out


def _model() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(TransformerConfig(hidden_size=48, num_layers=2, num_attention_heads=4, ffn_hidden_size=160,
                                       seq_length=SEQ, vocab_size=96, tie_embeddings=False))


def _run(zero: int, precision: str, grad_dtype: str = "") -> dict:
    plan = Plan(devices=2, dp=2, tp=1, pp=1, micro_batch=BATCH, global_batch=2 * BATCH * MICRO_BATCHES, zero=zero,
                precision=precision, grad_dtype=grad_dtype, blocks=(BlockPlan("layers.*", ((LayerStrategy(), 2),)),))
    model = _model()
    if precision == "bf16-mixed" and zero == 0:
        autocast_forward(model, precision, torch.device("cpu"))
    if zero == 0:
        wrapped = replicate(model, torch.device("cpu"))
        hook = ddp_micro_batch(wrapped)
    else:
        shard(model, plan, init_device_mesh("cpu", (2,)))
        wrapped, hook = model, fsdp_micro_batch(model, zero)
    params = list(model.parameters())
    shapes = {tuple(p.shape) for p in params} | {tuple(_local(p).shape) for p in params}
    elements = sum(p.numel() for p in params)
    optimizer = torch.optim.SGD(params, lr=0.0)
    tokens = torch.randint(0, 96, (MICRO_BATCHES, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    passes = None
    for step in range(2):
        optimizer.zero_grad()
        passes = GradientPasses(shapes)
        for i in range(MICRO_BATCHES):
            if hook is not None:
                hook(i == MICRO_BATCHES - 1)
            passes.micro_batch = i
            with passes if step == 1 else _Nothing():
                wrapped(tokens[i], tokens[i]).backward()
        optimizer.step()
    return {"micro_batches": passes.seen, "elements": elements}


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    dist.init_process_group("gloo")
    out = {f"zero{zero} {precision}{' ' + grad if grad else ''}": _run(zero, precision, grad)
           for zero, precision, grad in ((0, "32-true", ""), (0, "bf16-mixed", ""), (1, "bf16-mixed", ""),
                                         (1, "bf16-mixed", "bfloat16"), (3, "bf16-mixed", ""))}
    write_from_rank_0(out)


if __name__ == "__main__":
    main()
