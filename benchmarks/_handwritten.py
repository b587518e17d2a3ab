"""The training step of ``examples/train_gpt.py`` written by hand in plain torch, one parallelism at a time: what
``runtime_overhead.py`` times the torch engine's step against. Run by ``torch.distributed.run`` on 2 CPU workers:

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/_handwritten.py --mode sp --out times.json

The model, data, optimizer and step are those of ``examples/train_gpt.py`` (same seed, global batch 8 of 32 tokens,
AdamW lr 1e-3, float32); each mode applies torch's own API the way its documentation and torchtitan do, nothing of
TensorOpt's:

- ``ddp``: ``DistributedDataParallel`` (gradients as bucket views), 2 micro-batches, ``no_sync`` on the first;
- ``fsdp2``: ``fully_shard`` per layer and on the model (ZeRO 3), 2 micro-batches;
- ``tp``: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on each layer's linears, the
  vocabulary split (embedding ``RowwiseParallel``, head ``ColwiseParallel``, the loss under ``loss_parallel``);
- ``sp``: ``tp`` with sequence parallelism as torchtitan writes it: norms ``SequenceParallel``, each branch's input
  gathered by ``PrepareModuleInput``, its row linear reduce-scattering (``output_layouts=Shard(1)``), the stream
  entering the first layer whole and leaving the last whole;
- ``selective``: ``ddp`` with each layer's attention core (Q K^T, mask, softmax, dropout and the product with V)
  run under ``torch.utils.checkpoint`` (Megatron-LM's ``CoreAttention`` recomputation);
- ``pipeline``: two stages cut by ``torch.distributed.pipelining.pipeline`` before layer 2, ``Schedule1F1B`` over 4
  micro-batches.

Writes (rank 0) ``{"mode", "losses", "step_times_s"}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tensoropt.models.transformer import Attention, DecoderLM, TransformerConfig

MODES = ("ddp", "fsdp2", "tp", "sp", "selective", "pipeline")


def core_checkpointed(self: Attention, x, mask=None, rope=None):
    """``Attention.forward`` (eager, multi-head) with its core under ``torch.utils.checkpoint``."""
    b, s, _ = x.shape
    d = self.cfg.head_dim
    qkv = self.qkv(x).view(b, s, -1, 3, d)
    q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))

    def core(q, k, v):
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        return self.attn_dropout(scores.softmax(dim=-1)) @ v
    y = checkpoint(core, q, k, v, use_reentrant=False)
    return self.proj(y.transpose(1, 2).reshape(b, s, -1))


def tensor_parallel(model: DecoderLM, mesh, sequence: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    last = len(model.layers) - 1
    for i, layer in enumerate(model.layers):
        plan = {"attn.qkv": ColwiseParallel(), "mlp.up": ColwiseParallel()}
        if not sequence:
            plan |= {"attn.proj": RowwiseParallel(), "mlp.down": RowwiseParallel()}
        else:
            plan |= {"attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                     "mlp.down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                     "norm1": SequenceParallel(), "norm2": SequenceParallel(),
                     "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                     "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
            if i == 0:      # the stream enters whole, sliced locally
                plan[""] = PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                              desired_input_layouts=(Shard(1), None, None), use_local_output=False)
            if i == last:   # and leaves whole
                plan[""] = plan.get("") or None
                plan["__out__"] = None
        plan = {k: v for k, v in plan.items() if v is not None and k != "__out__"}
        parallelize_module(layer, mesh, plan)
        if sequence and i == last:
            parallelize_module(layer, mesh, PrepareModuleOutput(output_layouts=Shard(1),
                                                                desired_output_layouts=Replicate()))
    tied = model.head.weight is model.embed.weight
    parallelize_module(model, mesh, {"embed": RowwiseParallel(input_layouts=Replicate()),
                                     "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    if tied:
        model.head.weight = model.embed.weight


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = TransformerConfig(hidden_size=64, num_layers=4, num_attention_heads=4, ffn_hidden_size=256, seq_length=32,
                            vocab_size=128)
    model = DecoderLM(cfg)
    tokens = torch.randint(0, 128, (args.steps, 8, 33), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[..., :-1], tokens[..., 1:]
    step = _stepper(args.mode, model, rank, world)
    losses, times = [], []
    for i in range(args.steps):
        start = time.perf_counter()
        losses.append(step(inputs[i], targets[i]))
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"mode": args.mode, "losses": losses, "step_times_s": times}, f)
    dist.barrier()
    time.sleep(0.2)         # gloo's worker thread frees finished work first (tensoropt's Run.close says why)
    dist.destroy_process_group()


def _stepper(mode: str, model: DecoderLM, rank: int, world: int):
    """The step of ``mode`` on the global batch: forward, backward, AdamW; returns the step's mean loss."""
    if mode in ("ddp", "selective"):
        if mode == "selective":
            for layer in model.layers:
                layer.attn.forward = core_checkpointed.__get__(layer.attn)
        model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        return _accumulating(model, rank, world, micro_batches=2, no_sync=model.no_sync)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return _accumulating(model, rank, world, micro_batches=2)
    if mode in ("tp", "sp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel
        tensor_parallel(model, init_device_mesh("cpu", (world,)), sequence=mode == "sp")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(inputs, targets):
            optimizer.zero_grad(set_to_none=True)
            with loss_parallel():
                loss = model(inputs, targets)
                loss.backward()
            optimizer.step()
            return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        return step
    return _pipeline(model, rank, world)


def _accumulating(model, rank: int, world: int, micro_batches: int, no_sync=None):
    import contextlib
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        share = inputs.shape[0] // world
        mine = slice(rank * share, (rank + 1) * share)
        total = torch.zeros(())
        for i, (x, y) in enumerate(zip(inputs[mine].chunk(micro_batches), targets[mine].chunk(micro_batches))):
            with no_sync() if no_sync is not None and i < micro_batches - 1 else contextlib.nullcontext():
                loss = model(x, y) / micro_batches
                loss.backward()
            total += loss.detach()
        optimizer.step()
        dist.all_reduce(total)
        return float(total) / world
    return step


class _Logits(nn.Module):
    """``DecoderLM`` up to its logits: torch's pipeline schedules give the last stage's output and the micro-batch's
    target to a ``loss_fn`` (the same cross-entropy as ``DecoderLM.forward``'s)."""

    def __init__(self, model: DecoderLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        m, s = self.model, input_ids.shape[1]
        x = m.embed(input_ids) + m.pos_embed.weight[:s]
        x = m.dropout(x)
        for layer in m.layers:
            x = layer(x, m.causal_mask[:s, :s], None)
        return m.head(m.norm(x))


def _pipeline(model: DecoderLM, rank: int, world: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, SplitPoint, pipeline
    micro_batches = 4
    example = torch.zeros(8 // micro_batches, 32, dtype=torch.long)
    pipe = pipeline(_Logits(model), mb_args=(example,), split_spec={"model.layers.2": SplitPoint.BEGINNING})
    module = pipe.get_stage_module(rank)
    stage = PipelineStage(module, rank, world, torch.device("cpu"), group=dist.group.WORLD)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.reshape(-1))
    schedule = Schedule1F1B(stage, micro_batches, loss_fn=loss_fn, scale_grads=True)
    # the tied embedding: the first stage uses it as the embedding, the last as the head (each stage holds its copy)
    tied = module.get_parameter("model.embed.weight" if rank == 0 else "model.head.weight")

    def step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        losses: list = []
        if rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=losses)
        grad = tied.grad if tied.grad is not None else torch.zeros_like(tied)
        dist.all_reduce(grad)                # the tied embedding's gradient, summed over the two stages
        tied.grad = grad
        optimizer.step()
        total = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.all_reduce(total)
        return float(total)
    return step


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
