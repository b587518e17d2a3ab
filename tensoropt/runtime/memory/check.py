"""Peak tensor memory of one rank's training step: measured in a real run, or simulated without memory.

- ``TENSOROPT_MEMORY_OUT=PATH`` (honoured by ``tensoropt.parallelize`` in every worker): the engine's own step
  runs under a ``StepMemory`` tracker; after the second step (the steady state: the optimizer states exist,
  see ``run.reset_peak_memory``) each rank writes its peak by category to ``PATH`` with ``{rank}`` replaced.
- ``TENSOROPT_SIMULATE_MEMORY=PATH`` with ``TENSOROPT_PLAN`` (``tensoropt launch --dry-run --check-memory``
  runs the script so, every tensor on meta as in a capture): ``simulate`` joins a fake process group of the
  plan's world size as rank 0 (``torch.testing._internal.distributed.fake_pg``: collectives return at once,
  nothing is sent) and applies the plan through the torch engine's own ``apply`` under
  ``torch._subclasses.FakeTensorMode``: FSDP2, DDP, tensor and sequence parallelism, the recomputation
  wrappers, the optimizer, each as it runs, on tensors that have shapes and no storage. Two steps on
  micro-batches shaped like the script's example inputs run under the same tracker, and the second step's
  peak is written to ``PATH``. ``TENSOROPT_SIMULATE_RANK=R`` simulates rank R instead. LLaMA-2 70B on 64 devices
  (dp32 tp2 ZeRO 3) took ~60 s of CPU time.

The simulation runs on the CPU whatever the plan's device: the bytes a tensor takes do not depend on the
device, but a CUDA autocast casts a few ops differently from the CPU's (``torch.amp``'s per-device op lists),
and the engines' CUDA-only paths (NCCL, CUDA streams) are not exercised. DeepSpeed is not simulated
(``unsimulated``): it partitions and reduces with its own buffers and needs a real process group.

Pipeline plans run the simulated rank's stages (rank 0: pipeline stage 0, the most micro-batches in flight in
1F1B, and with virtual stages ``pp``, ``2 pp``, ...; the last stage's rank holds the head and its logits) through
the engine's own schedule executor (``pipeline_executor``): every stage knows its messages' shapes
(``pipeline_split.stage_messages``), so no shapes are exchanged; the fake group's sends and receives return at
once and leave the receive buffers as they are, which changes no byte (a real send is waited at its boundary too).
The tests hold both ranks' peaks of a pp2 run equal to the real run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from ...errors import TensorOptError
from ...graph.grouped_mm_meta import install_grouped_mm_meta
from ...space.plan import Plan
from ...space.run_plan import RunPlan
from ..engines.deepspeed_tensors import deepspeed_tensors
from .tracker import StepMemory

MEMORY_OUT_ENV, SIMULATE_ENV = "TENSOROPT_MEMORY_OUT", "TENSOROPT_SIMULATE_MEMORY"
RANK_ENV = "TENSOROPT_SIMULATE_RANK"     # the rank simulated (default 0): a pipeline's last stage is another
TRACKED_STEPS = 2                # the peak of the second: the steady state


class _Simulated(SystemExit):
    """Ends the simulation run of a script after the report is written (exit status 0)."""


def unsimulated(plan: Plan, engine: str) -> str | None:
    """Why this plan's step cannot be simulated on fake tensors, or None."""
    if engine != "torch":
        return (f"the {engine} engine is not simulated: it partitions and reduces with its own buffers and needs a "
                "real process group; measure a real run with TENSOROPT_MEMORY_OUT")
    if plan.compile:    # priced with the eager plan's memory (cost.model: compiling is a time fact)
        return ("compiled blocks are not simulated: dynamo and inductor would trace and compile the fake step; "
                "check the same plan without --compile, whose memory the compiled plan is priced with")
    return None


def _fsdp_tensors(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """FSDP2's gathered parameters and unsharded gradients (kept beside the registered sharded parameters)."""
    from torch.distributed.fsdp import FSDPModule
    params, grads = [], []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                params += list(getattr(fp, "all_gather_outputs", []) or [])
                unsharded = getattr(fp, "_unsharded_param", None)
                params.append(unsharded)
                grads += [getattr(unsharded, "grad", None), getattr(fp, "unsharded_accumulated_grad", None)]
    return params, grads


def register_model(tracker: StepMemory, model: nn.Module, optimizer) -> None:
    """Give the tracker the roles of what the model and optimizer hold now (memory_tracker's categories); a
    DeepSpeed optimizer's own buffers first (``deepspeed_tensors``), so the model's roles win where they share."""
    deepspeed = deepspeed_tensors(model, optimizer)
    offloaded = deepspeed.pop("offloaded", [])
    for role, tensors in deepspeed.items():
        tracker.register(role, tensors)
    fsdp_params, fsdp_grads = _fsdp_tensors(model)
    tracker.register("parameters", [*model.parameters(), *model.buffers(), *fsdp_params])
    tracker.register("gradients", [*(p.grad for p in model.parameters()), *fsdp_grads])
    states = getattr(optimizer, "state", None)         # a torch optimizer's; DeepSpeed's keeps its own
    if isinstance(states, Mapping):
        tracker.register("optimizer", [v for state in states.values() if isinstance(state, Mapping)
                                       for v in state.values()])
    tracker.register("offloaded", offloaded)      # host memory of an offloading DeepSpeed optimizer, told apart


def tracked_stepper(stepper: Callable, model: nn.Module, optimizer, done: Callable[[dict], None],
                    largest: bool = False) -> Callable:
    """``stepper`` whose first ``TRACKED_STEPS`` steps run under one ``StepMemory``; ``done(breakdown)`` gets
    the peak of the last of them by category (with ``largest``, and its largest storages under
    ``largest_at_peak``: ``StepMemory.largest_at_peak``). The optimizer's step is told apart (``optimizer`` phase)
    and the gradients are named just before it, when all of them exist."""
    tracker, steps = StepMemory(), [0]

    def pre_hook(*_):
        register_model(tracker, model, optimizer)
        tracker.optimizer_phase = True

    def post_hook(*_):
        tracker.optimizer_phase = False
        register_model(tracker, model, optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.register_step_pre_hook(pre_hook)
        optimizer.register_step_post_hook(post_hook)
    elif callable(getattr(optimizer, "step", None)):     # DeepSpeed's: its whole step (copies, gathers) is told apart
        optimizer.step = _phased(optimizer.step, pre_hook, post_hook)

    def step(micro_batches):
        if steps[0] >= TRACKED_STEPS:
            return stepper(micro_batches)
        register_model(tracker, model, optimizer)
        tracker.reset_peak()
        try:
            with tracker:
                return stepper(micro_batches)
        finally:
            steps[0] += 1
            register_model(tracker, model, optimizer)
            if steps[0] == TRACKED_STEPS:
                done(tracker.breakdown() | ({"largest_at_peak": tracker.largest_at_peak()} if largest else {}))
    return step


def _phased(step: Callable, before: Callable, after: Callable) -> Callable:
    """``step`` run between ``before()`` and ``after()``: the optimizer phase of an optimizer without step hooks."""
    def phased(*args, **kwargs):
        before()
        try:
            return step(*args, **kwargs)
        finally:
            after()
    return phased


def write_report(path: str, report: dict) -> None:
    from ...graph.cache import write_json_atomic
    write_json_atomic(Path(path), report)


def measuring(run, rank: int) -> None:
    """Under ``TENSOROPT_MEMORY_OUT``: track the run's steps (module doc)."""
    path = os.environ.get(MEMORY_OUT_ENV)
    if not path or run.stepper is None:
        return
    target = path.replace("{rank}", str(rank))
    run.stepper = tracked_stepper(run.stepper, run.model, run.optimizer,
                                  lambda b: write_report(target, {"rank": rank, "simulated": False} | b))


def _fake_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised fake tensor like ``t`` on ``device`` (a DTensor: its local shard fake, its layout kept)."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        local = torch.empty_like(t.to_local(), device=device)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return torch.empty_like(t, device=device)


class _FakeStorage:
    """The materializer of a simulation: this rank's part of the sharded meta-built model gets fake storage on
    ``device``, left uninitialised (values do not change the bytes a step takes). Each parameter and buffer is
    replaced (``Module._apply`` would swap tensors, which fake tensors refuse), tied parameters are tied again,
    and FSDP2 is told of its new shards as its own ``_apply`` does (``reset_sharded_param``)."""

    block_bytes: int | None = None           # read by the engines for the materializer's own messages

    def materialize(self, module: nn.Module, device: torch.device) -> None:
        from torch.distributed.fsdp import FSDPModule

        from .materialize import tie, tied_parameters
        tied = tied_parameters(module)
        for m in module.modules():
            for key, p in m._parameters.items():
                if p is not None:
                    m._parameters[key] = nn.Parameter(_fake_like(p, device), requires_grad=p.requires_grad)
            for key, b in m._buffers.items():
                if b is not None:
                    m._buffers[key] = _fake_like(b, device)
        for names in tied:
            tie(module, names)
        with torch.no_grad():            # FSDP2 takes its new shards as after Module._apply
            for m in module.modules():
                if isinstance(m, FSDPModule):
                    for group in m._get_fsdp_state()._fsdp_param_groups:
                        for fsdp_param in group.fsdp_params:
                            fsdp_param.reset_sharded_param()


def _micro_batch(example, samples: int, device: torch.device):
    """A micro-batch shaped like the script's example inputs with ``samples`` along dim 0 (fake: no values)."""
    if isinstance(example, torch.Tensor):
        return torch.zeros((samples, *example.shape[1:]), dtype=example.dtype, device=device)
    if isinstance(example, Mapping):
        return {k: _micro_batch(v, samples, device) for k, v in example.items()}
    if isinstance(example, (tuple, list)):
        return type(example)(_micro_batch(v, samples, device) for v in example)
    return example


class _BucketedGradients(nn.Module):
    """DDP's memory where DDP cannot run: its C++ reducer reads the parameters' data, which fake tensors do not
    have. What it holds is reproduced: one flat gradient bucket per dtype, allocated with the wrapper, which each
    parameter's ``.grad`` becomes a view of after its first accumulation (``gradient_as_bucket_view=True``, the
    engine's setting: autograd's fresh gradient is copied in and dropped); its all-reduce is in place. The
    tests hold this against real DDP runs measured by the same tracker."""

    def __init__(self, module: nn.Module, device_ids=None, process_group=None,
                 gradient_as_bucket_view: bool = True) -> None:
        super().__init__()
        self.module, self.require_backward_grad_sync = module, True
        groups: dict[torch.dtype, list[nn.Parameter]] = {}
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))   # as DDP: an expert's own .grad
        for name, p in module.named_parameters():
            if p.requires_grad and name not in ignored:
                groups.setdefault(p.dtype, []).append(p)
        self.buckets = []
        for dtype, params in groups.items():
            flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
            offset = 0
            for p in params:
                p.register_post_accumulate_grad_hook(self._into_bucket(flat[offset:offset + p.numel()].view_as(p)))
                offset += p.numel()
            self.buckets.append(flat)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _into_bucket(self, view: torch.Tensor) -> Callable[[nn.Parameter], None]:
        """As DDP's reducer: in a synchronising backward a gradient not yet in the bucket is copied there and
        ``.grad`` becomes the bucket's view; under ``no_sync`` (``require_backward_grad_sync`` False, every
        micro-batch but the last) gradients accumulate in ``.grad`` of their own, beside the bucket."""
        def hook(p: nn.Parameter) -> None:
            if self.require_backward_grad_sync and p.grad is not view:
                view.copy_(p.grad)
                p.grad = view
        return hook


@contextlib.contextmanager
def _bucketed_ddp() -> Iterator[None]:
    """The torch engine's DDP is ``_BucketedGradients`` within."""
    original = nn.parallel.DistributedDataParallel
    nn.parallel.DistributedDataParallel = _BucketedGradients
    try:
        yield
    finally:
        nn.parallel.DistributedDataParallel = original


@contextlib.contextmanager
def _outside_capture() -> Iterator[None]:
    """Leave the capture's torch-function modes (``capture_run``: every device is meta) while simulating: the
    simulation's tensors are fake CPU tensors."""
    with contextlib.ExitStack() as stack:
        while torch._C._len_torch_function_stack():
            stack.enter_context(torch.overrides._pop_mode_temporarily())
        yield


@contextlib.contextmanager
def _real_meshes() -> Iterator[None]:
    """Device meshes made with real rank tables: ``DeviceMesh`` reads its ranks back (``tolist``, ``nonzero``),
    which a fake tensor cannot give. Its tables are small; nothing else is made real."""
    import torch.distributed.device_mesh as device_mesh
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    originals = device_mesh.init_device_mesh, device_mesh.DeviceMesh.__init__, device_mesh.DeviceMesh.mesh

    def real(function):
        def outside_fake_mode(*args, **kwargs):
            with unset_fake_temporarily():
                return function(*args, **kwargs)
        return outside_fake_mode
    # ``DeviceMesh.mesh`` is computed from the rank map at each read (the pipeline engine reads its table)
    device_mesh.init_device_mesh, device_mesh.DeviceMesh.__init__ = map(real, originals[:2])
    device_mesh.DeviceMesh.mesh = property(real(originals[2].fget))
    try:
        yield
    finally:
        device_mesh.init_device_mesh, device_mesh.DeviceMesh.__init__, device_mesh.DeviceMesh.mesh = originals


def simulate(model: nn.Module, optimizer_fn, run_plan: RunPlan, example_inputs, rank: int = 0) -> dict:
    """``rank``'s peak tensor memory by category in the second step of ``plan`` (module doc); the model
    is built on meta. Rank 0 unless asked: a pipeline's last stage (the head and its logits) is another rank."""
    install_grouped_mm_meta()        # a float32 MoE layer's grouped products run on these fakes (graph.grouped_mm_meta)
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..engines.torch_engine import apply
    plan = run_plan.plan
    if reason := unsimulated(plan, run_plan.engine or "torch"):
        raise TensorOptError(reason)
    if not dist.is_initialized():
        if not 0 <= rank < plan.devices:
            raise TensorOptError(f"{RANK_ENV}={rank} is not a rank of the plan's {plan.devices} devices")
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.devices)
    device = torch.device("cpu")
    from ..parallel.tp_guard import unchecked  # here: DTensor's import (sympy) is not every launcher process's to pay
    with _outside_capture(), _real_meshes(), _bucketed_ddp(), unchecked(), \
            FakeTensorMode(allow_non_fake_inputs=True):
        on_cpu = dataclasses.replace(run_plan, device="cpu")
        model, optimizer, run = apply(model, optimizer_fn, on_cpu, device, _FakeStorage(), example_inputs)
        if optimizer is None:
            raise TensorOptError("tensoropt.parallelize was called without an optimizer_fn: there is no step to "
                                 "simulate")
        example = example_inputs if isinstance(example_inputs, (tuple, Mapping)) else (example_inputs,)
        micro = [run.sequence_share(_micro_batch(example, plan.micro_batch, device))
                 for _ in range(plan.grad_accumulation)]
        result: dict = {}
        stepper = tracked_stepper(run.stepper, model, optimizer, result.update, largest=True)
        for _ in range(TRACKED_STEPS):
            stepper(micro)          # the engines' steps leave the loss on the device: nothing reads a fake value
    if not result:
        raise TensorOptError("the simulated step did not reach the optimizer step")
    return {"rank": dist.get_rank(), "simulated": True} | result


def simulate_mode(model: nn.Module, optimizer_fn, example_inputs) -> None:
    """``tensoropt.parallelize`` under ``TENSOROPT_SIMULATE_MEMORY``: simulate, write the report, end the script."""
    run_plan = RunPlan.read(Path(os.environ["TENSOROPT_PLAN"]))
    rank = int(os.environ.get(RANK_ENV, "0"))
    write_report(os.environ[SIMULATE_ENV], simulate(model, optimizer_fn, run_plan, example_inputs, rank))
    raise _Simulated(0)


__all__ = ["MEMORY_OUT_ENV", "RANK_ENV", "SIMULATE_ENV", "TRACKED_STEPS", "measuring", "register_model", "simulate",
           "simulate_mode", "tracked_stepper", "unsimulated"]
