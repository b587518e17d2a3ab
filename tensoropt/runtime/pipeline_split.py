"""Cutting a model into pipeline stages for ``torch.distributed.pipelining``, and wiring the stages.

``torch.export`` traces the model on one micro-batch (its shapes become the stage-to-stage message shapes,
which pipelining needs to know in advance) and the cut points are the plan's block copies, so stage ``s``
runs its equal share of copies, stage 0 also what comes before the first copy (embeddings) and the last
stage what comes after the last (head and loss: the model's forward returns the loss, so the last stage's
output is the loss).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import TensorOptError
from ..space.plan import Plan
from .blocks import block_modules, copies_of
from .materialize import tie
from .run import Batch

# arguments of ``schedule.step`` itself: a model input of one of these names cannot be passed through it
_STEP_ARGUMENTS = {"target", "losses", "return_outputs", "loss_kwargs"}


@dataclass(frozen=True)
class Wiring:
    """How one stage of the split graph is fed and what it hands on, every value named by its node in the
    split graph. ``torch.distributed.pipelining`` moves activations only from a stage to the next and passes
    model inputs to a stage only as its own ``step`` arguments; the split graph may use a value several
    stages later (the attention mask) and a model input on a later stage (the labels). So each stage reads
    the model inputs it uses from the batch and relays what later stages need."""

    receives: tuple[str, ...]                 # values from the stage before, in order
    arguments: tuple[tuple[bool, str], ...]   # the stage module's arguments: (is a model input, name)
    outputs: tuple[tuple[str, int | None], ...]   # (name, index in its output tuple; None: the whole output)
    sends: tuple[str, ...] | None             # values for the next stage; None on the last (its output, the loss)

    @property
    def model_inputs(self) -> tuple[str, ...]:
        return tuple(name for is_input, name in self.arguments if is_input)


class Relay(nn.Module):
    """Runs a stage module as its ``Wiring`` says: received values and model inputs in, values for the next
    stage out (the stage's own outputs and relayed ones). Internal to the pipeline stage: the module a
    script gets back is the stage module itself, under the model's own parameter names."""

    def __init__(self, stage: nn.Module, wiring: Wiring) -> None:
        super().__init__()
        self.stage, self.wiring = stage, wiring

    def forward(self, *received, **model_inputs):
        wiring = self.wiring
        values = dict(zip(wiring.receives, received))
        output = self.stage(*(model_inputs[name] if is_input else values[name] for is_input, name in wiring.arguments))
        if wiring.sends is None:
            return output
        values.update((name, output if index is None else output[index]) for name, index in wiring.outputs)
        return tuple(values[name] for name in wiring.sends)


def retarget_devices(stage_module: nn.Module, device: torch.device) -> None:
    """Point the ops that create tensors (``device=`` arguments, fixed to the tracing device by the trace)
    at this rank's device, in the stage module's graph and its blocks' graphs."""
    from torch import fx
    for module in stage_module.modules():
        graph_module = module if isinstance(module, fx.GraphModule) else getattr(module, "graph_module", None)
        if not isinstance(graph_module, fx.GraphModule):
            continue
        nodes = [n for n in graph_module.graph.nodes if n.op == "call_function" and n.kwargs.get("device")
                 not in (None, device)]
        for node in nodes:
            node.update_kwarg("device", device)
        if nodes:
            graph_module.recompile()


def split_spec(model: nn.Module, plan: Plan) -> dict:
    """Split points before the first copy of every stage but the first, for ``pp * virtual_stages`` stages
    (device ``r`` runs stages ``r, r + pp, ...``: each gets an equal share of its device's copies). Refuses a
    plan whose per-stage mix of blocks the model's order of copies cannot give (a plan runs as planned)."""
    from torch.distributed.pipelining import SplitPoint
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    copies = sorted(block_modules(model, plan), key=order.__getitem__)
    pp, virtual = plan.pp, plan.virtual_stages
    stages = pp * virtual
    per_stage = len(copies) // stages
    if not copies or len(copies) % stages:
        raise TensorOptError(f"the model's {len(copies)} block copies do not split into {stages} equal pipeline stages"
                             + (f" ({pp} devices x {virtual} virtual stages)" if virtual > 1 else ""))
    per_device = {bp.block: bp.copies for bp in plan.blocks}
    if any(n % virtual for n in per_device.values()):
        raise TensorOptError(f"the plan puts block copies {per_device} on every device, which do not split into "
                             f"{virtual} equal virtual stages")
    planned = {block: n // virtual for block, n in per_device.items()}
    block_of = {name: bp.block for bp in plan.blocks for name in copies_of(model, bp.block)}
    for s in range(stages):
        share = copies[s * per_stage:(s + 1) * per_stage]
        got = {block: sum(block_of[n] == block for n in share) for block in planned}
        if got != planned:
            raise TensorOptError(f"pipeline stage {s} would run block copies {got} in model order, the plan puts "
                                 f"{planned} on every stage")
    return {copies[s * per_stage]: SplitPoint.BEGINNING for s in range(1, stages)}


def example_micro_batch(example: Batch, micro_batch: int) -> tuple[tuple, dict]:
    """(args, kwargs) of one micro-batch shaped like the plan's: the example's samples repeated or cut to
    ``micro_batch`` rows. Shapes matter, values do not: the trace fixes the shapes every stage exchanges."""
    def resize(x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        return x[torch.arange(micro_batch) % x.shape[0]]
    if isinstance(example, Mapping):
        return (), {k: resize(v) for k, v in example.items()}
    if isinstance(example, tuple):
        return tuple(resize(v) for v in example), {}
    return (resize(example),), {}


def tie_within_stage(stage_module: nn.Module, tied: list[tuple[str, ...]], held: set[str]) -> dict[int, nn.Parameter]:
    """Make every name of a tied group on this stage one parameter again (the split may hold unrelated
    copies, e.g. the embedding's and the unused head's); returns {group index: that parameter}."""
    shared = {}
    for index, group in enumerate(tied):
        present = [name for name in group if name in held]
        if not present:
            continue
        shared[index] = tie(stage_module, present)
    return shared


def stage_wiring(split_graph, stage_index: int) -> Wiring:
    """The ``Wiring`` of one stage, from the graph whose nodes call the stage modules in order."""
    stages = [n for n in split_graph.nodes if n.op == "call_module"]
    node = stages[stage_index]
    returned = [n.args[0] for n in split_graph.nodes if n.op == "output"]
    if node is stages[-1] and returned not in ([node], [(node,)]):
        raise TensorOptError("the model's output must be what its last pipeline stage computes (the loss)")
    arguments = tuple((a.op == "placeholder", a.target if a.op == "placeholder" else a.name) for a in node.args)
    if clash := _STEP_ARGUMENTS & {name for is_input, name in arguments if is_input}:
        raise TensorOptError(f"model inputs named {sorted(clash)} cannot be passed to a pipeline stage: rename the "
                             "forward's arguments")
    return Wiring(_carried(stages, stage_index - 1), arguments, _output_names(node),
                  _carried(stages, stage_index) if node is not stages[-1] else None)


def stage_messages(pipe, stage_index: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(what stage ``stage_index``'s ``Relay`` receives, what it hands on) as meta tensors shaped as the trace
    fixed them, for a ``PipelineStage`` built with its shapes up front (``input_args`` / ``output_args``: no
    stage then asks another for shapes, see ``torch.distributed.pipelining.stage.PipelineStage``). A floating
    point message requires a gradient, as torch's traced stages take it (``stage._PipelineStage.
    _create_act_recv_info``: ``torch.export`` records no ``requires_grad``); the first stage receives nothing
    (it reads model inputs only), the last hands on its output, the loss."""
    graph = pipe.split_gm.graph
    stages = [n for n in graph.nodes if n.op == "call_module"]
    values: dict[str, torch.Tensor] = {}
    for node in stages:
        module = pipe.get_stage_module(stages.index(node))
        returned = next(n for n in module.graph.nodes if n.op == "output").args[0]
        for name, index in _output_names(node):
            values[name] = _meta_message((returned if index is None else returned[index]).meta["val"])
    wiring = stage_wiring(graph, stage_index)
    sends = wiring.sends if wiring.sends is not None else (stages[stage_index].name,)
    return tuple(values[name] for name in wiring.receives), tuple(values[name] for name in sends)


def _meta_message(value: torch.Tensor) -> torch.Tensor:
    """A meta tensor with ``value``'s shape, strides and dtype, requiring a gradient if floating point."""
    empty = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return empty.requires_grad_(value.is_floating_point())


def _output_names(node) -> tuple[tuple[str, int | None], ...]:
    """Names of a stage's outputs: the ``getitem`` nodes that unpack its tuple, or its own name."""
    items = tuple((user.name, user.args[1]) for user in node.users if user.target is operator.getitem)
    return items or ((node.name, None),)


def _carried(stages: list, boundary: int) -> tuple[str, ...]:
    """Values computed up to stage ``boundary`` that stages after it use: what crosses that boundary."""
    if boundary < 0:
        return ()
    produced = {stage.name: i for i, stage in enumerate(stages)}

    def source(arg):
        return arg.args[0] if arg.target is operator.getitem else arg
    out: list[str] = []
    for stage in stages[boundary + 1:]:
        for arg in stage.args:
            if arg.op != "placeholder" and produced[source(arg).name] <= boundary and arg.name not in out:
                out.append(arg.name)
    return tuple(out)


__all__ = ["Relay", "Wiring", "example_micro_batch", "retarget_devices", "split_spec", "stage_messages",
           "stage_wiring", "tie_within_stage"]
