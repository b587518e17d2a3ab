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
  peak is written to ``PATH``. A 70B model on 64 devices takes seconds of one CPU core.

The simulation runs on the CPU whatever the plan's device: the bytes a tensor takes do not depend on the
device, but a CUDA autocast casts a few ops differently from the CPU's (``torch.amp``'s per-device op lists),
and the engines' CUDA-only paths (NCCL, CUDA streams) are not exercised. The pipeline and DeepSpeed engines are
not simulated (``unsimulated``): their schedules and their own allocators need a real process group.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from ..errors import TensorOptError
from .memory_tracker import StepMemory

MEMORY_OUT_ENV, SIMULATE_ENV = "TENSOROPT_MEMORY_OUT", "TENSOROPT_SIMULATE_MEMORY"
TRACKED_STEPS = 2                # the peak of the second: the steady state


class _Simulated(SystemExit):
    """Ends the simulation run of a script after the report is written (exit status 0)."""


def unsimulated(plan: Mapping, engine: str) -> str | None:
    """Why this plan's step cannot be simulated on fake tensors, or None."""
    if engine != "torch":
        return (f"the {engine} engine is not simulated: it partitions and reduces with its own buffers and needs a "
                "real process group; measure a real run with TENSOROPT_MEMORY_OUT")
    if plan["pp"] > 1:
        return ("pipeline stages are not simulated: torch.distributed.pipelining's schedules exchange shapes with "
                "the other stages; measure a real run with TENSOROPT_MEMORY_OUT")
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
    """Give the tracker the roles of what the model and optimizer hold now (memory_tracker's categories)."""
    fsdp_params, fsdp_grads = _fsdp_tensors(model)
    tracker.register("parameters", [*model.parameters(), *model.buffers(), *fsdp_params])
    tracker.register("gradients", [*(p.grad for p in model.parameters()), *fsdp_grads])
    if optimizer is not None:
        tracker.register("optimizer", [v for state in optimizer.state.values() for v in state.values()])


def tracked_stepper(stepper: Callable, model: nn.Module, optimizer, done: Callable[[dict], None]) -> Callable:
    """``stepper`` whose first ``TRACKED_STEPS`` steps run under one ``StepMemory``; ``done(breakdown)`` gets
    the peak of the last of them by category. The optimizer's step is told apart (``optimizer`` phase) and the
    gradients are named just before it, when all of them exist."""
    tracker, steps = StepMemory(), [0]

    def pre_hook(*_):
        register_model(tracker, model, optimizer)
        tracker.optimizer_phase = True

    def post_hook(*_):
        tracker.optimizer_phase = False
        register_model(tracker, model, optimizer)
    optimizer.register_step_pre_hook(pre_hook)
    optimizer.register_step_post_hook(post_hook)

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
                done(tracker.breakdown())
    return step


def write_report(path: str, report: dict) -> None:
    from ..graph.cache import write_json_atomic
    write_json_atomic(Path(path), report)


def measuring(run, rank: int) -> None:
    """Under ``TENSOROPT_MEMORY_OUT``: track the run's steps (module doc)."""
    path = os.environ.get(MEMORY_OUT_ENV)
    if not path or run.stepper is None:
        return
    target = path.replace("{rank}", str(rank))
    run.stepper = tracked_stepper(run.stepper, run.model, run.optimizer,
                                  lambda b: write_report(target, {"rank": rank, "simulated": False} | b))


class _FakeStorage:
    """The materializer of a simulation: a meta-built model gets fake storage on ``device`` for its part, left
    uninitialised (values do not change the bytes a step takes); tied parameters stay tied."""

    block_bytes: int | None = None

    def materialize(self, module: nn.Module, device: torch.device) -> None:
        from .materialize import tie, tied_parameters
        tied = tied_parameters(module)
        overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(True)    # new (fake) parameters, not .data
        try:
            module._apply(lambda t: torch.empty_like(t, device=device))
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
        for names in tied:
            tie(module, names)


def _micro_batch(example, samples: int, device: torch.device):
    """A micro-batch shaped like the script's example inputs with ``samples`` along dim 0 (fake: no values)."""
    if isinstance(example, torch.Tensor):
        return torch.zeros((samples, *example.shape[1:]), dtype=example.dtype, device=device)
    if isinstance(example, Mapping):
        return {k: _micro_batch(v, samples, device) for k, v in example.items()}
    if isinstance(example, (tuple, list)):
        return type(example)(_micro_batch(v, samples, device) for v in example)
    return example


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
    """Device meshes made with real rank tables: ``DeviceMesh`` reads its ranks back (``tolist``), which a fake
    tensor cannot give."""
    import torch.distributed.device_mesh as device_mesh
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    original = device_mesh.init_device_mesh

    def init_device_mesh(*args, **kwargs):
        with unset_fake_temporarily():
            return original(*args, **kwargs)
    device_mesh.init_device_mesh = init_device_mesh
    try:
        yield
    finally:
        device_mesh.init_device_mesh = original


def simulate(model: nn.Module, optimizer_fn, plan: dict, example_inputs) -> dict:
    """Rank 0's peak tensor memory by category in the second step of ``plan`` (module doc); the model
    is built on meta."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .torch_engine import apply
    if reason := unsimulated(plan, plan.get("engine", "torch")):
        raise TensorOptError(reason)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan["devices"])
    device = torch.device("cpu")
    with _outside_capture(), _real_meshes(), FakeTensorMode(allow_non_fake_inputs=True):
        model, optimizer, run = apply(model, optimizer_fn, dict(plan, device="cpu"), device, _FakeStorage(),
                                      example_inputs)
        if optimizer is None:
            raise TensorOptError("tensoropt.parallelize was called without an optimizer_fn: there is no step to "
                                 "simulate")
        example = example_inputs if isinstance(example_inputs, (tuple, Mapping)) else (example_inputs,)
        micro = [_micro_batch(example, plan["micro_batch"], device) for _ in range(plan["gradient_accumulation"])]
        result: dict = {}
        stepper = tracked_stepper(run.stepper, model, optimizer, result.update)
        for _ in range(TRACKED_STEPS):
            try:
                stepper(micro)
            except DataDependentOutputException:
                pass          # the step's loss read back to the host (``float``): fake tensors have no value
    if not result:
        raise TensorOptError("the simulated step did not reach the optimizer step")
    return {"rank": 0, "simulated": True} | result


def simulate_mode(model: nn.Module, optimizer_fn, example_inputs) -> None:
    """``tensoropt.parallelize`` under ``TENSOROPT_SIMULATE_MEMORY``: simulate, write the report, end the script."""
    plan = json.loads(Path(os.environ["TENSOROPT_PLAN"]).read_text())
    write_report(os.environ[SIMULATE_ENV], simulate(model, optimizer_fn, plan, example_inputs))
    raise _Simulated(0)


__all__ = ["MEMORY_OUT_ENV", "SIMULATE_ENV", "TRACKED_STEPS", "measuring", "register_model", "simulate",
           "simulate_mode", "tracked_stepper", "unsimulated"]
