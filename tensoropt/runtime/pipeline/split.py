"""Cutting a model into pipeline stages for ``torch.distributed.pipelining``, and wiring the stages.

``torch.export`` traces the model on one micro-batch (its shapes become the stage-to-stage message shapes,
which pipelining needs to know in advance) and the cut points are the plan's block copies, so stage ``s``
runs its equal share of copies, stage 0 also what comes before the first copy (embeddings) and the last
stage what comes after the last (head and loss: the model's forward returns the loss, or an output with ``.loss``
traced as returning that alone, ``pipeline_trace``, so the last stage's output is the loss).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx, nn

from ...errors import TensorOptError
from ...space.plan import Plan
from ..blocks import block_modules, copies_of
from ..memory.materialize import tie
from ..run import Batch


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


def saved_buffers(model: nn.Module) -> set[str]:
    """The full names of the buffers ``model`` saves in its state dict (not those registered ``persistent=False``,
    such as a Llama's rotary ``inv_freq``)."""
    return {f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules(remove_duplicate=False)
            for name in module._buffers if name not in module._non_persistent_buffers_set}


def keep_out_of_state_dict(stage_module: nn.Module, saved: set[str]) -> None:
    """Mark every buffer of the stage module that the model does not save (``saved_buffers``) as not persistent:
    ``torch.export`` lifts every buffer, and the constants a forward makes (Falcon's ``lifted_tensor_0``...), into
    the unflattened stage, whose state dict (a checkpoint, ``Run.full_state_dict``) would then hold names the
    model's does not."""
    for prefix, module in stage_module.named_modules():
        for name in module._buffers:
            if (f"{prefix}.{name}" if prefix else name) not in saved:
                module._non_persistent_buffers_set.add(name)


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
    return Wiring(_carried(stages, stage_index - 1), arguments, _output_names(node),
                  _carried(stages, stage_index) if node is not stages[-1] else None)


def stage_messages(pipe, stage_index: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(what stage ``stage_index``'s ``Relay`` receives, what it hands on) as meta tensors shaped as the trace
    fixed them, for a ``PipelineStage`` built with its shapes up front (``input_args`` / ``output_args``: no
    stage then asks another for shapes, see ``torch.distributed.pipelining.stage.PipelineStage``); the first
    stage receives nothing (it reads model inputs only), the last hands on its output, the loss.

    A message requires a gradient only where one can flow back through it (``message_gradients``): torch's
    stage takes a received tensor as requiring one when its meta says so (``stage._retrieve_recv_activations``),
    and ``torch.export`` records no ``requires_grad``. Marking every floating-point message would make a stage
    that receives tables computed from buffers (a Llama's rotary cos/sin, relayed from the first stage) save
    their partners in every product for a backward that feeds nothing: 72 MiB a Llama-3-8B layer per
    micro-batch in the simulated step, and a gradient sent back for each."""
    graph = pipe.split_gm.graph
    stages = [n for n in graph.nodes if n.op == "call_module"]
    gradients = message_gradients(pipe)
    values: dict[str, torch.Tensor] = {}
    for node in stages:
        module = pipe.get_stage_module(stages.index(node))
        returned = next(n for n in module.graph.nodes if n.op == "output").args[0]
        for name, index in _output_names(node):
            values[name] = _meta_message((returned if index is None else returned[index]).meta["val"],
                                         gradients[name])
    wiring = stage_wiring(graph, stage_index)
    sends = wiring.sends if wiring.sends is not None else (stages[stage_index].name,)
    return tuple(values[name] for name in wiring.receives), tuple(values[name] for name in sends)


def message_gradients(pipe) -> dict[str, bool]:
    """{message name: whether a gradient can flow back through it}: whether it is computed, in the stage graphs,
    from a parameter that requires one or from a message that does. Model inputs (token ids, labels) need none.
    An op needs one where any of its inputs does (so a detached value counts as needing one: a gradient sent
    for nothing costs time, a missing one would break the backward)."""
    graph = pipe.split_gm.graph
    stages = [n for n in graph.nodes if n.op == "call_module"]
    out: dict[str, bool] = {}
    for index, node in enumerate(stages):
        flags = _gradient_flow(pipe.get_stage_module(index),
                               [False if a.op == "placeholder" else out[a.name] for a in node.args])
        for name, item in _output_names(node):
            out[name] = _any(flags if item is None or not isinstance(flags, tuple) else flags[item])
    return out


def _any(flag) -> bool:
    return any(_any(f) for f in flag) if isinstance(flag, tuple) else bool(flag)


def _gradient_flow(module: nn.Module, inputs: list):
    """Whether each output of ``module`` (a bool, or a tuple of them for a tuple output) needs a gradient, given
    whether each of its positional inputs does: through its graph where it has one (the stage modules and the
    modules ``torch.export.unflatten`` keeps inside them), else conservatively (any input or parameter)."""
    graph = getattr(module, "graph", None)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"] if graph is not None else []
    if graph is None or len(placeholders) != len(inputs):
        return any(map(_any, inputs)) or _trains(module)
    flags: dict = dict(zip(placeholders, inputs))
    for node in graph.nodes:
        if node.op == "get_attr":
            attribute = _attribute(module, node.target)
            flags[node] = isinstance(attribute, torch.Tensor) and attribute.requires_grad
        elif node.op == "call_module":
            inner = module.get_submodule(node.target)
            flags[node] = _gradient_flow(inner, [flags[a] if isinstance(a, fx.Node) else False for a in node.args]) \
                if not node.kwargs else any(_any(flags[n]) for n in node.all_input_nodes) or _trains(inner)
        elif node.op == "call_function" and node.target is operator.getitem and isinstance(flags[node.args[0]], tuple):
            flags[node] = flags[node.args[0]][node.args[1]]
        elif node.op == "output":
            return _as_tuples(fx.node.map_arg(node.args[0], lambda n: flags[n]))
        elif node.op != "placeholder":
            flags[node] = any(_any(flags[n]) for n in node.all_input_nodes)
    return True


def _as_tuples(flags):
    return tuple(_as_tuples(f) for f in flags) if isinstance(flags, (list, tuple)) else flags


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _attribute(module: nn.Module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _meta_message(value: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A meta tensor with ``value``'s shape, strides and dtype, requiring a gradient if floating point and
    ``requires_grad``."""
    empty = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return empty.requires_grad_(value.is_floating_point() and requires_grad)


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


__all__ = ["Relay", "Wiring", "example_micro_batch", "keep_out_of_state_dict", "message_gradients",
           "retarget_devices", "saved_buffers", "split_spec",
           "stage_messages", "stage_wiring", "tie_within_stage"]
