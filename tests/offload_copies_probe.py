"""Run by ``tests/test_offload_price.py`` in its own process: one DeepSpeed rank (gloo, CPU) trains a tiny bf16
model with the optimizer offloaded, under the config tensoropt writes, for each ``ZERO:MICRO_BATCHES`` argument,
and prints (as JSON, by argument) how many bytes the second step copied into or out of DeepSpeed's host-side
gradient buffers (its running sums of the micro-batches), in units of the model's bf16 gradients."""

import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tensoropt.profiler.collectives import free_port
from tensoropt.runtime.engines.deepspeed_engine import skip_inference_all_reduce_op
from tensoropt.runtime.engines.ds_config import deepspeed_config
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan


class HostCopies(TorchDispatchMode):
    """Bytes of every ``copy_`` whose source or destination lies in one of ``storages`` (data pointers)."""

    def __init__(self, storages: set[int]):
        super().__init__()
        self.storages, self.bytes = storages, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if {dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr()} & self.storages:
                self.bytes += dst.numel() * dst.element_size()
        return func(*args, **(kwargs or {}))


def host_gradient_buffers(optimizer) -> set[int]:
    """ZeRO 1-2: ``accumulated_grads_in_cpu`` (made at a step's first accumulation); ZeRO 3: the flat host buffer of
    gradient partitions."""
    buffers = list(getattr(optimizer, "accumulated_grads_in_cpu", {}).values())
    if getattr(optimizer, "grad_partitions_flat_buffer", None) is not None:
        buffers.append(optimizer.grad_partitions_flat_buffer)
    return {b.untyped_storage().data_ptr() for b in buffers}


def copies(zero: int, micro_batches: int) -> float:
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    plan = Plan(devices=1, dp=1, tp=1, pp=1, micro_batch=2, global_batch=2 * micro_batches, zero=zero, offload=True,
                blocks=(BlockPlan("0", ((LayerStrategy("none"), 1),)),), precision="bf16-mixed", engine="deepspeed")
    skip_inference_all_reduce_op(deepspeed)        # as the engine does: no gcc run for an op training never calls
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=deepspeed_config(plan, params))

    def step() -> None:
        for _ in range(micro_batches):
            loss = engine(torch.randn(2, 32, dtype=torch.bfloat16)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()

    step()
    with HostCopies(host_gradient_buffers(engine.optimizer)) as seen:
        step()
    return seen.bytes / (2 * params)


def main() -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cases = [tuple(int(n) for n in arg.split(":")) for arg in sys.argv[1:]]
    print(json.dumps({f"{zero}:{m}": copies(zero, m) for zero, m in cases}))


if __name__ == "__main__":
    main()
