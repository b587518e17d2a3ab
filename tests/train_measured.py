"""A meta-built GPT trained through ``tensoropt.parallelize``, measured: used by ``test_deepspeed_gpu_path`` as a
script run alone and under ``tensoropt launch`` (DeepSpeed ZeRO 3, bf16), and by ``test_pipeline`` (the torch
engine's pipeline stages, sharded before they are placed).

Writes ``OUT.init.<rank>.npz``, every parameter's initial value (gathered), and ``OUT.<rank>.json`` with the
per-step losses and what the plan's application held on this rank:

- ``model_bytes``: the parameters of the whole model;
- ``peak_bytes``: the most CPU tensor memory allocated at once from the call of ``tensoropt.parallelize``
  until the engine asks the script for its optimizer (the model is then on the device), from the memory events
  of ``torch.profiler`` (``profile_memory``: every allocation and free of this thread, with its size);
- ``resident_parameter_bytes``: the parameter storage this rank holds then (a ZeRO 3 parameter's partition);
- for a DeepSpeed run, the precision it trains in: ``bf16_enabled``, the dtype of its weights, of its gradients
  after the last step, and of its optimizer's master copy.

``--oom-in-init``: the model's ``init_fn`` raises ``torch.OutOfMemoryError`` when it initialises real storage
(materialisation in a worker; the runtime's trace on fake tensors before it goes through).
"""

import argparse
import contextlib
import json
import os

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.profiler import ProfilerActivity, profile

import tensoropt
from tensoropt.models.transformer import DecoderLM, TransformerConfig, init_weights
from tensoropt.runtime import CAPTURE_ENV


def peak_allocated_bytes(prof: profile) -> int:
    """The most bytes allocated at once while ``prof`` ran (allocations minus frees, in time order)."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    alive = peak = 0
    for event in events:
        alive += event.nbytes()
        peak = max(peak, alive)
    return peak


def held(p: torch.Tensor) -> torch.Tensor:
    """The storage this rank holds for a parameter: a DeepSpeed ZeRO 3 parameter's partition, a DTensor's (FSDP2,
    tensor parallelism) local shard, any other one whole."""
    from torch.distributed.tensor import DTensor
    if isinstance(p, DTensor):
        return p.to_local()
    return p.ds_tensor if getattr(p, "ds_tensor", None) is not None else p


def precision_report(engine) -> dict:
    """What a DeepSpeed engine trains in: its mode, and the dtypes of its weights, gradient communication, the
    optimizer's master copy and (ZeRO 3) gradient partitions."""
    optimizer = engine.optimizer
    masters = getattr(optimizer, "fp32_partitioned_groups_flat", None) \
        or getattr(optimizer, "single_partition_of_fp32_groups", None) or getattr(optimizer, "fp32_groups_flat", None)
    grads = getattr(optimizer, "grad_partitions_flat_buffer", None)
    return {"bf16_enabled": engine.bfloat16_enabled(), "weight_dtype": str(held(next(engine.parameters())).dtype),
            "communication_dtype": str(engine.communication_data_type),
            "master_dtype": str(masters[0].dtype) if masters else None,
            "gradient_dtype": str(grads.dtype) if grads is not None else None}


def initial_values(model) -> dict[str, np.ndarray]:
    """Every parameter's value, whole (a DeepSpeed ZeRO 3 engine's gathered from the ranks' partitions)."""
    module = getattr(model, "module", model)
    params = dict(module.named_parameters())
    gather = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params.values()):
        import deepspeed
        gather = deepspeed.zero.GatheredParameters(list(params.values()))
    from torch.distributed.tensor import DTensor
    with gather:          # a DTensor gathered whole (every rank of its mesh takes part, in one order)
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().numpy().copy()
                for name, p in params.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--oom-in-init", action="store_true")
    parser.add_argument("--out", default="measured")
    args = parser.parse_args()

    torch.manual_seed(0)
    cfg = TransformerConfig(hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=4,
                            ffn_hidden_size=4 * args.hidden, seq_length=args.seq_len, vocab_size=256)
    with tensoropt.meta_init():
        model = DecoderLM(cfg).to(getattr(torch, args.dtype))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = torch.randint(0, cfg.vocab_size, (args.steps, args.global_batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[..., :-1], tokens[..., 1:]

    def init_fn(module: torch.nn.Module) -> None:
        own = list(module.parameters(recurse=False))
        if args.oom_in_init and own and not any(isinstance(p, FakeTensor) for p in own):
            raise torch.OutOfMemoryError(f"simulated: no memory to initialise {type(module).__name__}")
        init_weights(module)

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    measured = {}

    def optimizer_fn(params):
        params = list(params)
        prof.stop()                               # the plan is applied: the model is on the device
        measured["peak_bytes"] = peak_allocated_bytes(prof)
        measured["resident_parameter_bytes"] = sum(held(p).numel() * held(p).element_size() for p in params)
        return torch.optim.AdamW(params, lr=1e-3)

    if not os.environ.get(CAPTURE_ENV):           # the launcher's capture run traces only (and under no profiler)
        prof.start()
    try:
        model, optimizer, run = tensoropt.parallelize(model, optimizer_fn, global_batch=args.global_batch,
                                                      example_inputs=(inputs[0, :1], targets[0, :1]), init_fn=init_fn)
    finally:
        if not measured and not os.environ.get(CAPTURE_ENV):
            prof.stop()                           # a process that exits with the profiler on crashes (SIGSEGV)
    np.savez(f"{args.out}.init.{run.rank}.npz", **initial_values(model))
    losses = [run.train_step((inputs[step], targets[step])) for step in range(args.steps)]
    report = {"losses": losses, "model_bytes": model_bytes, "engine": run.engine} | measured
    if run.engine == "deepspeed":
        report |= precision_report(model)
    with open(f"{args.out}.{run.rank}.json", "w") as f:
        json.dump(report, f)
    run.close()


if __name__ == "__main__":
    main()
