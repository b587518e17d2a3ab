"""Apply a plan inside a training script: ``tensoropt.parallelize``.

The one call a training script makes::

    model, optimizer, run = tensoropt.parallelize(model, lambda params: torch.optim.AdamW(params, lr=1e-3),
                                                  example_inputs=batch, global_batch=32)

- Run by hand (no launcher): nothing changes; ``run`` says dp = 1, one micro-batch per step, so the
  same script can be debugged in one process.
- Under ``tensoropt launch`` in capture mode (``TENSOROPT_CAPTURE_OUT`` set): the model is captured
  on fake tensors from ``example_inputs``, the graph is written for the launcher, and the process
  exits; nothing trains. This is how the launcher learns the model from the script itself.
- Under ``tensoropt launch`` with a plan (``TENSOROPT_PLAN`` set, workers started by torchrun): the
  process group is joined and the plan applied with the torch-native engine: recomputation per
  block copy (checkpoint wrappers), data parallelism as DDP (ZeRO 0-1) or FSDP2 ``fully_shard``
  (ZeRO 2: gradients and optimizer states sharded; ZeRO 3: parameters too).

Tensor and pipeline parallelism and the DeepSpeed engine are not applied yet: a plan that needs them
is refused with one line (the launcher only picks plans this runtime can run).
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import TensorOptError

CAPTURE_ENV, PLAN_ENV = "TENSOROPT_CAPTURE_OUT", "TENSOROPT_PLAN"


@dataclass(frozen=True)
class RunInfo:
    """What a training loop needs to know about the plan it runs under."""

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    micro_batch: int = 0             # samples per forward on this rank (0: the whole global batch)
    grad_accumulation: int = 1
    global_batch: int = 0
    plan: dict | None = None

    def close(self) -> None:
        """End the run: wait for every rank, then leave the process group. Tearing gloo down while a
        peer still talks aborts the process ("terminate called without an active exception")."""
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def local_batches(self, batch: torch.Tensor | tuple | Mapping):
        """Split a global batch into this rank's micro-batches (rank-major, in order)."""
        def take(x, i):
            if not isinstance(x, torch.Tensor):
                return x
            per_rank = x.shape[0] // self.dp_size
            mine = x[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
            size = per_rank // self.grad_accumulation
            return mine[i * size:(i + 1) * size]
        for i in range(self.grad_accumulation):
            if isinstance(batch, Mapping):
                yield {k: take(v, i) for k, v in batch.items()}
            elif isinstance(batch, tuple):
                yield tuple(take(v, i) for v in batch)
            else:
                yield take(batch, i)


class _Captured(SystemExit):
    """Ends a capture-mode run after the graph is written (exit status 0)."""


def parallelize(model: nn.Module, optimizer_fn: Callable[[object], torch.optim.Optimizer] | None = None, *,
                example_inputs: tuple | Mapping | torch.Tensor | None = None, global_batch: int | None = None):
    """Return (model, optimizer, RunInfo) for the plan this process runs under (see module doc)."""
    if os.environ.get(CAPTURE_ENV):
        _capture_and_exit(model, example_inputs, global_batch)
    plan_path = os.environ.get(PLAN_ENV)
    if not plan_path:
        optimizer = optimizer_fn(model.parameters()) if optimizer_fn else None
        return model, optimizer, RunInfo(global_batch=global_batch or 0)
    plan = json.loads(Path(plan_path).read_text())
    return _apply(model, optimizer_fn, plan)


def _capture_and_exit(model, example_inputs, global_batch) -> None:
    from ..graph.cache import write_json_atomic
    from ..graph.capture import trace_module
    if example_inputs is None or not global_batch:
        raise TensorOptError("tensoropt.parallelize needs example_inputs (one micro-batch) and global_batch for "
                             "the launcher to capture the model")
    inputs = example_inputs if isinstance(example_inputs, (tuple, Mapping)) else (example_inputs,)
    first = next(v for v in (inputs.values() if isinstance(inputs, Mapping) else inputs) if isinstance(v, torch.Tensor))
    graph = trace_module(model, inputs, type(model).__name__, {"batch_size": str(first.shape[0]),
                                                               "seq_len": str(first.shape[1]) if first.dim() > 1
                                                               else "", "global_batch": str(global_batch)})
    write_json_atomic(Path(os.environ[CAPTURE_ENV]), graph.to_json())
    raise _Captured(0)


def unsupported(plan: dict) -> list[str]:
    """What a plan (its JSON) needs that this runtime does not apply yet; empty when it can run."""
    strategies = [s for b in plan["blocks"] for s in b["strategies"]]
    return [what for what, needed in (
        ("tensor parallelism", plan["tp"] != 1), ("pipeline stages", plan["pp"] != 1),
        ("ZeRO 1", plan["zero"] == 1), ("optimizer offload", plan["offload"]),
        ("selective recomputation", any(s["recompute"] == "selective" for s in strategies)),
        ("sequence parallelism", any(s["sequence_parallel"] for s in strategies)),
    ) if needed]


def _apply(model: nn.Module, optimizer_fn, plan: dict):
    import torch.distributed as dist
    if missing := unsupported(plan):     # never run a plan as something else than what was planned
        raise TensorOptError(f"plan {plan['summary']} needs {', '.join(missing)}, which the torch runtime does "
                             "not apply yet")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != plan["dp"]:
        raise TensorOptError(f"plan wants dp {plan['dp']} but {world} workers were started")
    _apply_recompute(model, plan)
    if plan["zero"] >= 2:
        from torch.distributed.fsdp import fully_shard
        reshard = plan["zero"] == 3                          # ZeRO 2 keeps parameters gathered
        for name in _block_modules(model, plan):
            fully_shard(model.get_submodule(name), reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = optimizer_fn(model.parameters()) if optimizer_fn else None
    info = RunInfo(rank, world, rank, world, plan["micro_batch"], plan["gradient_accumulation"],
                   plan["global_batch"], plan)
    return model, optimizer, info


def _block_modules(model: nn.Module, plan: dict) -> list[str]:
    """Module names of every copy of the plan's blocks, in model order (``layers.*`` -> layers.0...)."""
    names = [n for n, _ in model.named_modules()]
    out = []
    for block in plan["blocks"]:
        pattern = block["block"]
        out += [n for n in names if fnmatch.fnmatchcase(n, pattern) and n.count(".") == pattern.count(".")]
    return out


def _apply_recompute(model: nn.Module, plan: dict) -> None:
    """Wrap the first copies of each block in checkpointing as the plan's strategy counts say (full
    recomputation; ``_apply`` refuses selective before this runs)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for block in plan["blocks"]:
        copies = [n for n in _block_modules(model, {"blocks": [block]})]
        strategies = [s["recompute"] for s in block["strategies"] for _ in range(s["copies"])]
        for name, recompute in zip(copies, strategies):
            if recompute == "full":
                parent_name, _, child = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, child, checkpoint_wrapper(getattr(parent, child)))
