"""The pipeline schedule run on this device: its stages' forwards and backwards in the order
``space.pipeline_schedule`` gives, and the stage-to-stage messages at its boundaries.

Why not ``torch.distributed.pipelining``'s schedules: as of torch 2.13 a ``PipelineStage`` allocates a receive
buffer per micro-batch for its inputs and another for its outputs' gradients when it is set up for a step of ``m``
micro-batches, and the interleaved schedule keeps every send's work, and so its tensor, to the end of the step:
``(2 v - 1) m`` messages on the first device, where Megatron-LM holds what is in flight. Here a buffer exists from
the boundary its message arrives at until its forward reads it (then it is the stage's input) or its backward has
used it, a send is complete when its boundary is, and a sent output keeps no storage (below): what a device holds
for its messages is what ``space.pipeline_schedule.held_messages`` counts, and the cost model prices that.

A stage's output is needed after its send only for its autograd history: the backward starts from it. Its values
are not (no op of the stage saves its own last output, checked before it is freed: ``_releasable``), so once
sent its storage is swapped for an empty one, as Megatron-LM's ``deallocate_output_tensor`` does, and the backward
is run from it with the gradient received, through autograd's engine directly (``torch.autograd.backward`` would
compare the gradient's shape with the emptied output's).

Data parallelism inside a stage communicates as the plan is priced: each stage's gradients are reduced during
its last backward of the step only where they accumulate whole (DDP under ZeRO 0: every forward runs under
``no_sync``, and the reducer is prepared for the last backward, as torch's own pipeline stage does it; FSDP2 under
ZeRO 1: ``set_requires_gradient_sync`` for that backward only, ``StageRunner.before_backward``, the hook the whole
model's micro-batches get too). Under ZeRO 2/3 FSDP2 reduce-scatters every backward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ...space.pipeline_schedule import ACTIVATION, FORWARD, GRADIENT, Action, Boundary, Message, Step
from ..device import local_tensor


@dataclass
class StageRunner:
    """One pipeline stage this device runs: its module (wrapped for data parallelism), the shapes of what it
    receives and sends (meta tensors, ``pipeline_split.stage_messages``), and what its backwards need."""

    module: nn.Module
    index: int
    stages: int
    received: tuple[torch.Tensor, ...]
    sent: tuple[torch.Tensor, ...]
    device: torch.device
    # what FSDP2 is told before each backward: whether it is the stage's last of the step (``data_parallel``)
    before_backward: Callable[[bool], None] | None = None
    # micro-batch -> (the forward's outputs, the received inputs): what its backward starts from and feeds
    pending: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = field(default_factory=dict)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    def buffers(self, what: str) -> list[torch.Tensor]:
        """Empty tensors for a message this stage receives: its inputs (``ACTIVATION``) or its outputs' gradients
        (``GRADIENT``, for the outputs a gradient flows back through)."""
        metas = self.received if what == ACTIVATION else [m for m in self.sent if m.requires_grad]
        return [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=self.device) for m in metas]

    def forward(self, micro_batch: int, inputs: Sequence[torch.Tensor], model_inputs: Mapping[str, object]):
        """Run the stage on one micro-batch; keep what its backward needs; return its output (the model's output
        on the last stage, else the tuple of values for the next stage)."""
        received = tuple(x.requires_grad_(m.requires_grad) for x, m in zip(inputs, self.received))
        with _no_gradient_sync(self.module):
            output = self.module(*received, **model_inputs)
        outputs = output if isinstance(output, tuple) and not self.is_last else (output,)
        self.pending[micro_batch] = (outputs, received)
        return output

    def backward(self, micro_batch: int, gradients: Sequence[torch.Tensor] | None, loss: torch.Tensor | None,
                 last: bool) -> list[torch.Tensor]:
        """The backward of one micro-batch, from the scaled ``loss`` (last stage) or the gradients of the outputs
        that need one; returns the gradients of the received inputs that need one (zeros where none flowed).
        ``last``: the stage's last backward of the step, where gradients that accumulate whole are reduced."""
        outputs, received = self.pending.pop(micro_batch)
        if self.before_backward is not None:
            self.before_backward(last)
        with _ddp_sync(self.module, last, outputs):
            if loss is not None:
                loss.backward()
            else:
                tensors = [o for o, m in zip(outputs, self.sent) if m.requires_grad]
                torch.autograd.graph._engine_run_backward(tuple(tensors), tuple(gradients), False, False, (),
                                                          allow_unreachable=True, accumulate_grad=True)
        return [x.grad if x.grad is not None else torch.zeros_like(x) for x in received if x.requires_grad]

    def release(self, micro_batch: int) -> None:
        """Free the storage of the outputs just sent (module doc): only their autograd history is needed now."""
        outputs, _ = self.pending[micro_batch]
        for output in outputs:
            for tensor in _releasable(output):
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _releasable(output: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storage goes when a sent output's does (none where it must stay): the output, computed here
    (not a leaf such as a relayed input or a view of a buffer: it has a history) and not read by its own backward (a
    node that saves its result, e.g. ``exp``, keeps ``_saved_result``); and where it views the whole of another
    tensor (a sequence-parallel share handed on is ``DTensor.to_local()``'s view of the DTensor's local tensor), that
    one too, if nothing reads it in a backward either: computed with a history that does not save it, or below
    autograd (no history, no gradient: a DTensor's local tensor). A tensor subclass (a DTensor, whose storage is its
    local shard's) or a partial view is left alone."""
    def plain(t) -> bool:
        return isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t)
    if not plain(output) or output.grad_fn is None or hasattr(output.grad_fn, "_saved_result"):
        return []
    base = output._base
    if base is None:
        return [output]
    unread = (base.grad_fn is not None and not hasattr(base.grad_fn, "_saved_result")) or \
        (base.grad_fn is None and not base.requires_grad)
    return [output, base] if plain(base) and base._base is None and base.numel() == output.numel() and unread else []


def _ddp(module: nn.Module) -> bool:
    """Whether ``module`` is DDP (or the simulation's stand-in for it, ``memory_check``): it has the flag."""
    return hasattr(module, "require_backward_grad_sync") and hasattr(module, "module")


class _no_gradient_sync:
    """A DDP stage's forward runs without preparing its reducer (``DistributedDataParallel.no_sync``): several
    forwards are in flight before their backwards, and the reducer is prepared for the last backward only."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module if _ddp(module) else None

    def __enter__(self) -> None:
        if self.module is not None:
            self.before, self.module.require_backward_grad_sync = self.module.require_backward_grad_sync, False

    def __exit__(self, *exc) -> None:
        if self.module is not None:
            self.module.require_backward_grad_sync = self.before


class _ddp_sync:
    """Around one backward of a DDP stage: its reducer prepared and its gradients all-reduced in the stage's last
    backward of the step only (module doc)."""

    def __init__(self, module: nn.Module, last: bool, outputs: tuple[torch.Tensor, ...]) -> None:
        self.module = module if _ddp(module) else None
        self.last, self.outputs = last, outputs

    def __enter__(self) -> None:
        if self.module is None:
            return
        self.module.require_backward_grad_sync = self.last
        if self.last and hasattr(self.module, "reducer"):       # the simulation's stand-in has no reducer
            from torch.nn.parallel.distributed import _find_tensors
            self.module.reducer.prepare_for_backward(list(_find_tensors(self.outputs)))

    def __exit__(self, *exc) -> None:
        if self.module is not None:
            self.module.require_backward_grad_sync = True


def peer_rank(stage: int, pp_group) -> int:
    """The global rank of the device in this rank's pipeline that runs ``stage``."""
    import torch.distributed as dist
    return dist.get_global_rank(pp_group, stage % dist.get_world_size(pp_group))


def exchange(boundary: Boundary, runners: Mapping[int, StageRunner], outbox: dict[Message, list[torch.Tensor]],
             inbox: dict[Message, list[torch.Tensor]], pp_group) -> None:
    """Post every send and receive of one boundary at once, in the schedule's order, and wait for them; the sent
    activations' storage is then freed (module doc)."""
    import torch.distributed as dist
    ops = []
    for message in boundary.sends:
        for tensor in outbox[message]:
            ops.append(dist.P2POp(dist.isend, tensor, peer_rank(message.to_stage, pp_group), pp_group))
    for message in boundary.receives:
        receiver = runners[message.to_stage]
        inbox[message] = receiver.buffers(ACTIVATION if message.what == ACTIVATION else GRADIENT)
        for tensor in inbox[message]:
            ops.append(dist.P2POp(dist.irecv, tensor, peer_rank(message.stage, pp_group), pp_group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for message in boundary.sends:
        del outbox[message]
        if message.what == ACTIVATION:
            runners[message.stage].release(message.micro_batch)


def run_schedule(steps: Sequence[Step], runners: Mapping[int, StageRunner], model_inputs: Sequence[Mapping],
                 loss_of: Callable[[object], torch.Tensor], pp_group) -> list[torch.Tensor]:
    """Run one step's schedule on this device (``steps``: ``space.pipeline_schedule.device_steps``) and return
    the losses of the micro-batches its last stage computed (none where it holds no last stage). Each micro-batch's
    loss is divided by their number before its backward: the gradients of the step's mean loss, as one process
    computes them (``run.plain_stepper``)."""
    micro_batches = len(model_inputs)
    last_backward = {}
    for step in steps:
        if isinstance(step, Action) and step.kind != FORWARD:
            last_backward[step.stage] = step.micro_batch
    outbox: dict[Message, list[torch.Tensor]] = {}
    inbox: dict[Message, list[torch.Tensor]] = {}
    # a loss with its history until its backward (its graph reaches the received inputs: kept later, it would keep
    # them and their gradients), then only its value
    losses: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}
    for step in steps:
        if isinstance(step, Boundary):
            exchange(step, runners, outbox, inbox, pp_group)
        elif step.kind == FORWARD:
            _forward(step, runners[step.stage], model_inputs[step.micro_batch], loss_of, inbox, outbox, losses, values)
        else:
            _backward(step, runners[step.stage], micro_batches, last_backward[step.stage] == step.micro_batch,
                      inbox, outbox, losses)
    if outbox or inbox or losses or any(r.pending for r in runners.values()):
        raise AssertionError("the pipeline schedule left messages or micro-batches behind")
    return [values[mb] for mb in sorted(values)]


# One action each, in a function of its own: what an action reads or makes is referenced from the inbox, the outbox,
# the losses and the runner's pending micro-batches only, never from a local of the schedule's loop, which would keep
# it (the last received input, the last input gradient sent) alive through the next action.
def _forward(step: Action, runner: StageRunner, model_inputs: Mapping, loss_of: Callable[[object], torch.Tensor],
             inbox: dict, outbox: dict, losses: dict, values: dict) -> None:
    mb = step.micro_batch
    inputs = () if runner.is_first else inbox.pop(Message(ACTIVATION, step.stage - 1, mb))
    output = runner.forward(mb, inputs, model_inputs)
    if runner.is_last:
        losses[mb] = loss_of(output)
        values[mb] = local_tensor(losses[mb]).detach()
    else:
        outbox[Message(ACTIVATION, step.stage, mb)] = list(output)


def _backward(step: Action, runner: StageRunner, micro_batches: int, last: bool, inbox: dict, outbox: dict,
              losses: dict) -> None:
    mb = step.micro_batch
    gradients = None if runner.is_last else inbox.pop(Message(GRADIENT, step.stage + 1, mb))
    loss = losses.pop(mb) / micro_batches if runner.is_last else None
    sent = runner.backward(mb, gradients, loss, last)
    if not runner.is_first:
        outbox[Message(GRADIENT, step.stage, mb)] = sent


__all__ = ["StageRunner", "exchange", "peer_rank", "run_schedule"]
