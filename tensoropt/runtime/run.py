"""``Run``: the handle a training script gets back from ``tensoropt.parallelize``.

One training step is ``run.train_step(batch)`` with the *global* batch, the same on every rank: the
run takes this rank's data-parallel slice, splits it into the plan's micro-batches and lets the
engine do forward, backward, gradient accumulation and the optimizer step its own way (DDP and
FSDP2 hooks, DeepSpeed's ``engine.backward``/``engine.step``, a pipeline schedule). Engines differ in
how a step is driven, so the script never drives it by hand and runs unchanged under every plan.

``train_step`` returns the step's mean loss as a Python float, which reads it back from the device: a host
synchronisation every step, which keeps the CPU from queueing the next step's kernels while this one runs.
``train_step(batch, sync=False)`` returns it as a 0-dim float32 tensor on the device instead (already averaged over
the data-parallel ranks), so a script reads it (``float(loss)``) only where it logs. ``local=True`` takes a batch
holding only this rank's rows (``run.local_rows()``: its data-parallel share of the global batch), so a script
loads only what its rank trains on rather than every rank the whole global batch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import TensorOptError
from ..graph.loss import loss_problem, loss_tensor
from ..space.run_plan import RunPlan
from . import RUN_DIR_ENV, SIMULATED_MEMORY_ENV  # noqa: F401  (named with the launcher's variables)
from .checkpoint.files import KEEP
from .device import check_placement, local_tensor, to_device
from .engines.compile import compile_report
from .parallel.context_parallel import shard_batch

Batch = torch.Tensor | tuple | Mapping
# an engine's step: this rank's micro-batches in, the step's loss (mean over the whole batch, a 0-dim float32 tensor
# on the device: read back only by the script, ``Run.train_step``) out
Stepper = Callable[[list[Batch]], torch.Tensor]


def call_model(model, batch: Batch):
    """Call the model on one micro-batch: a mapping as keywords, a tuple as positional arguments."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple):
        return model(*batch)
    return model(batch)


def loss_of(output) -> torch.Tensor:
    """The loss a model's forward returned (``graph.loss``: the tensor itself, ``output.loss`` or
    ``output["loss"]``); anything else is the one-line error the capture gives."""
    loss = loss_tensor(output)
    if loss is None:
        raise TensorOptError(f"run.train_step: the model's forward {loss_problem(output)}")
    return loss


def split_batch(batch: Batch, part: int, parts: int) -> Batch:
    """Part ``part`` of ``parts`` equal slices along dim 0 of every tensor in the batch."""
    def take(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.shape[0] % parts:
            raise TensorOptError(f"a batch of {x.shape[0]} samples does not split into {parts} equal parts: make the "
                                 "global batch what the plan was made for")
        size = x.shape[0] // parts
        return x[part * size:(part + 1) * size]
    if isinstance(batch, Mapping):
        return {k: take(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(take(v) for v in batch)
    return take(batch)


def plain_stepper(model, optimizer, before_micro_batch: Callable[[bool], object] | None = None,
                  dp_group=None, loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                  ) -> Stepper:
    """Forward and backward every micro-batch, then one optimizer step (one process, DDP, FSDP2, TP);
    the loss is averaged over ``dp_group`` (default: every rank). Each micro-batch's forward and backward
    run inside ``loss_context()`` (torch's ``loss_parallel`` for vocabulary-split logits, which needs both).

    ``before_micro_batch(last)`` is told whether the coming micro-batch is the step's last, for the
    engine to communicate as the cost model assumes: DDP reduces gradients after the last only,
    FSDP2 under ZeRO 2 keeps its parameters gathered until then."""
    def step(micro_batches: list[Batch]) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        total = None
        for i, micro in enumerate(micro_batches):
            if before_micro_batch:
                before_micro_batch(i == len(micro_batches) - 1)
            with loss_context():
                loss = loss_of(call_model(model, micro)) / len(micro_batches)
                loss.backward()
            value = local_tensor(loss.detach()).float()      # loss_parallel's loss is a replicated DTensor
            total = value if total is None else total + value
        optimizer.step()
        return mean_over_group(total, dp_group)
    return step


def mean_over_group(value: torch.Tensor, group=None) -> torch.Tensor:
    """Average a loss (on the device the step ran on: NCCL reduces GPU tensors only) over a process group
    (the data-parallel ranks); identity without one. Stays on the device: no host synchronisation (an NCCL
    all-reduce is queued on the device's stream)."""
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        value = value.clone()
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return value


def host_copy(value, keep: bool = True):
    """A state-dict value whole, as a CPU tensor of its own (None unless ``keep``: a DTensor is gathered anyway,
    as every rank must take part). The whole value gathered on the device is gone when this returns."""
    from torch.distributed.tensor import DTensor
    whole = value.full_tensor() if isinstance(value, DTensor) else value
    if not keep:
        return None
    return whole.detach().to("cpu", copy=True) if isinstance(whole, torch.Tensor) else whole


def _across_stages(own: dict, group, device: torch.device, keep: bool) -> dict:
    """The whole model's state from each pipeline rank's ``own`` (its stages' values, on the host): every name once,
    broadcast over ``group`` by the first rank that holds it (a tied parameter's copies on several stages are kept
    equal, ``pipeline.sum_shared_gradients``), one tensor at a time through ``device`` (NCCL moves device tensors
    only); {} unless ``keep``. Only names, shapes and dtypes travel as objects."""
    import torch.distributed as dist
    layouts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(layouts, {n: (tuple(v.shape), v.dtype) for n, v in own.items()}, group=group)
    me, out = dist.get_rank(group), {}
    for name in sorted(set().union(*layouts)):
        owner = next(r for r, layout in enumerate(layouts) if name in layout)
        shape, dtype = layouts[owner][name]
        buffer = own[name].to(device) if owner == me else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buffer, group=group, group_src=owner)
        if keep:
            out[name] = own[name] if owner == me else buffer.to("cpu", copy=True)
    return out


def _is_zero3(model) -> bool:
    """Parameters partitioned by DeepSpeed ZeRO 3 (each holds only ``ds_tensor``, this rank's slice)."""
    return isinstance(model, torch.nn.Module) and any(hasattr(p, "ds_id") for p in model.parameters())


def _zero3_values(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict of a DeepSpeed ZeRO 3 model, each partitioned parameter gathered whole only while it is
    read (every rank takes part in each gather), so at most one whole parameter is on the device at once."""
    import deepspeed
    module = getattr(model, "module", model)                  # the script's model inside DeepSpeed's engine
    for name, value in module.state_dict(keep_vars=True).items():
        if hasattr(value, "ds_id"):
            with deepspeed.zero.GatheredParameters([value]):
                yield name, value.detach()
        else:
            yield name, value


CLOSE_GRACE_S = 0.2                 # see Run.close
OOM_EXIT_CODE = 75                  # a worker ran out of device memory (the launcher re-plans with less)
CHECKPOINT_EXIT_CODE = 74           # a checkpoint could not be written or loaded (sysexits' EX_IOERR)


def _simulate_out_of_memory(plan: RunPlan | None) -> None:
    """Devices with ``TENSOROPT_SIMULATED_MEMORY_BYTES`` each: a plan predicted to need more fails as a
    real out-of-memory error would (CPU workers never run out of memory at these sizes; tests need to)."""
    limit = os.environ.get(SIMULATED_MEMORY_ENV)
    needed = plan.predicted.peak_memory_bytes if plan is not None and plan.predicted is not None else 0
    if limit and needed > int(limit):
        raise torch.OutOfMemoryError(f"simulated: the plan needs {needed} bytes per device, the device has {limit}")


def _report_failure(kind: str, step: int, rank: int, message: str) -> None:
    """Leave the launcher a note of why this worker stops (it only sees exit codes otherwise)."""
    if run_dir := os.environ.get(RUN_DIR_ENV):
        from ..graph.cache import write_json_atomic
        write_json_atomic(Path(run_dir) / f"failure-rank{rank}.json",
                          {"kind": kind, "step": step, "rank": rank, "message": message})


@contextlib.contextmanager
def exit_on_checkpoint_error(step: int, rank: int) -> Iterator[None]:
    """A checkpoint that cannot be written, or a whole one that does not load, ends the worker with
    ``CHECKPOINT_EXIT_CODE`` and no traceback: a note the launcher turns into its one-line error (every rank gets
    the same ``CheckpointError``: the ranks decide together), or, run without the launcher, the line itself on
    rank 0's stderr."""
    from ..errors import CheckpointError, error_line
    try:
        yield
    except CheckpointError as exc:
        _report_failure("checkpoint", step, rank, str(exc))
        if not os.environ.get(RUN_DIR_ENV) and rank == 0:
            print(error_line(exc), file=sys.stderr, flush=True)
        raise SystemExit(CHECKPOINT_EXIT_CODE) from None


@contextlib.contextmanager
def exit_on_out_of_memory(step: int, rank: int) -> Iterator[None]:
    """An out-of-memory error ends the worker with ``OOM_EXIT_CODE`` and a note for the launcher (an elastic run
    re-plans with less memory per device), whether it came in a step or while the plan was applied."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        _report_failure("oom", step, rank, str(exc).splitlines()[0])
        raise SystemExit(OOM_EXIT_CODE) from exc


def reset_peak_memory(device: torch.device) -> None:
    """Forget the device's memory peaks (GPUs only): called after a process's first step, whose one-off
    allocations (materialisation, engine set-up, first-step workspaces) no later step repeats, so that
    ``Run.device_report`` gives the peak of a step in the steady state, the one plans are priced at
    (the optimizer state made by the first step stays allocated and is counted)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@dataclass
class Run:
    """Where this process stands in the plan, and how it trains one step."""

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    micro_batch: int = 0             # samples per forward on this rank (0: the whole global batch)
    grad_accumulation: int = 1
    global_batch: int = 0
    plan: RunPlan | None = None      # the plan.json this worker runs (None: run by hand)
    engine: str = "none"             # none (run by hand) | torch | deepspeed
    stepper: Stepper | None = field(default=None, repr=False)
    step: int = 0                    # optimizer steps done (resumed runs start at the checkpoint's)
    start_step: int = 0              # the step this process resumed from: the training loop starts here
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = KEEP      # the newest checkpoints kept (launch --keep-checkpoints)
    model: object = field(default=None, repr=False)
    optimizer: object = field(default=None, repr=False)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))   # where this rank trains
    # the process group of this rank's pipeline (one rank per stage device), None without pipeline stages
    pipeline_group: object = field(default=None, repr=False)
    # context parallelism: (cp, this rank's cp index, the sequence length it splits); None without
    context: tuple[int, int, int] | None = None
    _placement_checked: bool = field(default=False, repr=False)

    def local_rows(self, global_batch: int | None = None) -> range:
        """The rows of a global batch (of ``global_batch`` samples, default the plan's) this rank trains on: its
        data-parallel share, in order (every rank of one data-parallel replica, its tensor-parallel and pipeline
        ranks, the same). Load only these and pass them with ``local=True``."""
        total = global_batch or self.global_batch
        if not total or total % self.dp_size:
            raise TensorOptError(f"run.local_rows: a global batch of {total} samples does not split into "
                                 f"{self.dp_size} equal data-parallel shares: give the global batch the plan was made "
                                 "for")
        size = total // self.dp_size
        return range(self.dp_rank * size, (self.dp_rank + 1) * size)

    def local_batches(self, batch: Batch, local: bool = False) -> list[Batch]:
        """This rank's micro-batches of a global batch (its data-parallel slice, split in order; ``local``: the
        batch is that slice already), on its device: only this rank's share of the batch is ever copied there."""
        mine = self.sequence_share(batch if local else split_batch(batch, self.dp_rank, self.dp_size))
        return [to_device(split_batch(mine, i, self.grad_accumulation), self.device)
                for i in range(self.grad_accumulation)]

    def sequence_share(self, batch: Batch) -> Batch:
        """This rank's tokens of every sequence in ``batch`` under context parallelism (its chunks,
        ``parallel.context_parallel.shard_batch``); the batch itself otherwise."""
        if self.context is None:
            return batch
        cp, cp_rank, length = self.context
        return shard_batch(batch, length, cp, cp_rank)

    def train_step(self, batch: Batch, local: bool = False, sync: bool = True) -> float | torch.Tensor:
        """One optimizer step on the global ``batch`` (``local``: only this rank's rows of it, ``local_rows``);
        returns its mean loss, the same on every rank: a float, read back from the device (a host synchronisation),
        or with ``sync=False`` a 0-dim float32 tensor on this rank's device, not read back (the script reads it,
        ``float(loss)``, where it logs)."""
        if self.stepper is None:
            raise TensorOptError("tensoropt.parallelize was called without an optimizer_fn: there is nothing to step")
        if self.plan is not None and not self._placement_checked:
            check_placement(self.model, self.device, "run.train_step")   # the script may have moved it since
            self._placement_checked = True
        with exit_on_out_of_memory(self.step, self.rank):
            _simulate_out_of_memory(self.plan)
            loss = self.stepper(self.local_batches(batch, local))
        self.step += 1
        if self.step == self.start_step + 1:
            reset_peak_memory(self.device)
        if self.checkpoint_dir and self.checkpoint_every and self.step % self.checkpoint_every == 0:
            from .checkpoint.sharded import save
            with exit_on_checkpoint_error(self.step, self.rank):
                save(Path(self.checkpoint_dir), self.step, self.model, self.optimizer, self.checkpoint_keep)
        return float(loss) if sync else loss

    def device_report(self) -> dict:
        """Where this rank trained: its device, the devices its parameters sit on, and the most device
        memory its tensors took (``max_memory_allocated``) and its caching allocator held
        (``max_memory_reserved``) since the first step (see ``reset_peak_memory``); GPUs only, None on
        CPUs, where torch keeps no such count. With what compiled here (``compile.compile_report``)."""
        params = self.model.parameters() if isinstance(self.model, torch.nn.Module) else ()
        gpu = self.device.type == "cuda"
        return {"device": str(self.device), "parameter_devices": sorted({str(local_tensor(p).device) for p in params}),
                "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(self.device) if gpu else None,
                "max_memory_reserved_bytes": torch.cuda.max_memory_reserved(self.device) if gpu else None,
                **compile_report(self.model)}

    def full_state_dict(self, ranks: Collection[int] | None = None) -> dict:
        """The whole model's parameters as CPU tensors of their own (a copy, not the run's memory), under the
        script's own parameter names, on every rank in ``ranks`` (default: all; the others get ``{}``): for
        saving a final model or comparing runs. Every rank must call it: the gathers are collectives.

        Gathered one tensor at a time, each copied to the host before the next is gathered, so the device
        holds at most one whole parameter beyond its own shards (the whole model would not fit on one GPU
        that trains only its shards of it). With pipeline stages each rank first gathers its own stages' and then
        the pipeline's ranks hand them to each other, again one tensor at a time (``_across_stages``)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from .parallel.feature_order import feature_orders, in_model_order
        wanted = ranks is None or self.rank in ranks
        keep = wanted or self.pipeline_group is not None        # a stage's own values are sent on
        orders, out = feature_orders(self.model), {}
        values = (_zero3_values(self.model) if _is_zero3(self.model)
                  else iter(get_model_state_dict(self.model).items()))
        for name, value in values:
            host = host_copy(value, keep)
            if keep:
                out[name] = in_model_order(host, *orders[name]) if name in orders else host   # fused projections
        if self.pipeline_group is not None:
            out = _across_stages(out, self.pipeline_group, self.device, wanted)
        return out

    def close(self) -> None:
        """End the run: wait for every rank, then leave the process group.

        Between the two, the process sleeps a moment without the GIL. Gloo's worker thread frees each
        finished collective after the caller saw it complete, and freeing its tensors takes the GIL; a
        process group destroyed before that, with the GIL held (the last reference may sit in DDP's
        Reducer, freed when the script's model goes), joins that thread and waits forever, or aborts
        ("terminate called without an active exception"). pytorch/pytorch#56297."""
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            time.sleep(CLOSE_GRACE_S)
            dist.destroy_process_group()
