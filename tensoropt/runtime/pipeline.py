"""Pipeline stages for the torch engine, with ``torch.distributed.pipelining``.

The model is cut generically: ``torch.export`` traces it on one micro-batch (its shapes become the
stage-to-stage message shapes, which pipelining needs to know in advance) and the cut points are the
plan's block copies, so stage ``s`` runs its equal share of copies, stage 0 also what comes before
the first copy (embeddings) and the last stage what comes after the last (head and loss: the model's
forward returns the loss, so the last stage's output is the loss). Each rank keeps its own stage
module, an optimizer over it and a 1F1B schedule (what the cost model assumes; GPipe when there are
fewer micro-batches than stages, which 1F1B does not run). One rank runs one stage: ``pp`` equals the
number of devices (``unsupported`` refuses data or tensor parallelism beside stages).

Parameters used on several stages (tied input and output embeddings) are copied onto each stage by
the split; their gradients are summed over those stages before the optimizer step, so the copies
take identical steps and stay equal, as the one shared parameter of the unsplit model would.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import TensorOptError
from .device import to_device
from .materialize import Materializer, tie, tied_parameters
from .param_groups import build_optimizer
from .precision import autocast_forward, of_plan, traced_autocast
from .run import Batch, Run, Stepper, loss_of
from .torch_engine import block_modules, recompute_wrappers, replace_module

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


def apply_pipeline(model: nn.Module, optimizer_fn: Callable[[object], torch.optim.Optimizer] | None, plan: dict,
                   device: torch.device, materializer: Materializer | None = None,
                   example_inputs: Batch | None = None) -> tuple[nn.Module, object, Run]:
    """Cut ``model`` into ``plan["pp"]`` stages and return this rank's (stage module, optimizer, Run); only
    this rank's stage is put on ``device`` (a meta-built model: only its stage gets storage)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, pipeline

    from .torch_engine import place
    if example_inputs is None:
        raise TensorOptError("pipeline stages are cut by tracing one micro-batch: pass example_inputs to "
                             "tensoropt.parallelize")
    if plan.get("virtual_stages", 1) > 1:
        raise TensorOptError(f"plan {plan['summary']} interleaves {plan['virtual_stages']} virtual stages per "
                             "device, which the torch engine does not run")
    rank, pp = dist.get_rank(), plan["pp"]
    tied, recomputed = tied_parameters(model), recompute_wrappers(model, plan)
    signature = inspect.signature(model.forward)
    if materializer is not None:        # a meta-built model is cut on meta, buffers too (their values are kept)
        model._apply(lambda t: t.to("meta"))
    trace_device = next(iter(model.parameters())).device
    args, kwargs = to_device(example_micro_batch(example_inputs, plan["micro_batch"]), trace_device)
    with traced_autocast(of_plan(plan), trace_device):        # bf16-mixed: the stages' graphs compute in bf16
        pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs, split_spec=split_spec(model, plan))
    if pipe.num_stages != pp:
        raise TensorOptError(f"cutting the model before its block copies gave {pipe.num_stages} pipeline stages, "
                             f"the plan has {pp}: every block copy must be called once by the model's forward")
    held = [{name for name, _ in pipe.get_stage_module(s).named_parameters(remove_duplicate=False)}
            for s in range(pp)]
    stage_module = pipe.get_stage_module(rank)
    retarget_devices(stage_module, device)          # before recomputation wraps the blocks' graphs
    place(stage_module, device, materializer)       # before tying: a meta-built stage gets new parameters
    shared = tie_within_stage(stage_module, tied, held[rank])
    reductions = shared_gradient_groups(shared, tied, held, rank)
    for name in sorted(recomputed.keys() & {n for n, _ in stage_module.named_modules()}):
        replace_module(stage_module, name, recomputed[name])
    wiring = stage_wiring(pipe.split_gm.graph, rank)
    del pipe                                        # the other stages' modules go with it
    relay = Relay(stage_module, wiring)
    autocast_forward(relay, of_plan(plan), device)                  # and runs under the autocast it was traced in
    stage = PipelineStage(relay, rank, pp, device)
    optimizer = build_optimizer(optimizer_fn, stage_module.parameters())
    stepper = None
    if optimizer is not None:
        stepper = pipeline_stepper(stage, plan["gradient_accumulation"], optimizer, signature, wiring.model_inputs,
                                   reductions, device)
    run = Run(rank, dist.get_world_size(), 0, 1, plan["micro_batch"], plan["gradient_accumulation"],
              plan["global_batch"], plan, "torch", stepper, device=device)
    return stage_module, optimizer, run


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


def split_spec(model: nn.Module, plan: dict) -> dict:
    """Split points before the first copy of every stage but the first; refuses a plan whose per-stage
    mix of blocks the model's order of copies cannot give (a plan must run as it was planned)."""
    from torch.distributed.pipelining import SplitPoint
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    copies = sorted(block_modules(model, plan), key=order.__getitem__)
    pp = plan["pp"]
    per_stage = len(copies) // pp
    if not copies or len(copies) % pp:
        raise TensorOptError(f"the model's {len(copies)} block copies do not split into {pp} equal pipeline stages")
    planned = {b["block"]: sum(s["copies"] for s in b["strategies"]) for b in plan["blocks"]}
    block_of = {name: b["block"] for b in plan["blocks"] for name in block_modules(model, {"blocks": [b]})}
    for s in range(pp):
        share = copies[s * per_stage:(s + 1) * per_stage]
        got = {block: sum(block_of[n] == block for n in share) for block in planned}
        if got != planned:
            raise TensorOptError(f"pipeline stage {s} would run block copies {got} in model order, the plan puts "
                                 f"{planned} on every stage")
    return {copies[s * per_stage]: SplitPoint.BEGINNING for s in range(1, pp)}


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


def shared_gradient_groups(shared: dict[int, nn.Parameter], tied: list[tuple[str, ...]], held: list[set[str]],
                           rank: int) -> list[tuple[nn.Parameter, object]]:
    """(parameter, process group) for each tied parameter this stage holds with other stages. Every rank
    creates the same groups in the same order, as ``new_group`` requires; the whole world needs none."""
    import torch.distributed as dist
    out, groups = [], {}
    for index, group in enumerate(tied):
        ranks = tuple(s for s, names in enumerate(held) if any(name in names for name in group))
        if len(ranks) < 2:
            continue
        if ranks not in groups:
            groups[ranks] = None if len(ranks) == dist.get_world_size() else dist.new_group(list(ranks))
        if rank in ranks:
            out.append((shared[index], groups[ranks]))
    return out


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


def concatenate(micro_batches: list[Batch]) -> Batch:
    """This rank's micro-batches joined back into its batch: the schedule splits it again itself."""
    first = micro_batches[0]

    def join(values):
        return torch.cat(values) if isinstance(values[0], torch.Tensor) else values[0]
    if isinstance(first, Mapping):
        return {k: join([m[k] for m in micro_batches]) for k in first}
    if isinstance(first, tuple):
        return tuple(join([m[i] for m in micro_batches]) for i in range(len(first)))
    return join(micro_batches)


def named_inputs(batch: Batch, signature: inspect.Signature, device: torch.device) -> dict[str, object]:
    """The batch as {forward argument name: value}, tensors on ``device``; the split graph names the model's
    inputs after the forward's arguments."""
    try:
        if isinstance(batch, Mapping):
            bound = signature.bind(**batch)
        else:
            bound = signature.bind(*(batch if isinstance(batch, tuple) else (batch,)))
    except TypeError as exc:
        raise TensorOptError(f"the batch does not fit the model's forward{signature}: {exc}") from exc
    return to_device(dict(bound.arguments), device)


def pipeline_stepper(stage, n_microbatches: int, optimizer: torch.optim.Optimizer, signature: inspect.Signature,
                     model_inputs: tuple[str, ...], reductions: list, device: torch.device) -> Stepper:
    """The Run's stepper: one schedule step over this rank's micro-batches, tied gradients summed over
    their stages, one optimizer step; returns the step's mean loss, broadcast from the last stage."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    kind = Schedule1F1B if n_microbatches >= stage.num_stages else ScheduleGPipe
    # the model's forward returns each micro-batch's mean loss; scale_grads divides the summed gradients by
    # the number of micro-batches: the gradients of the step's mean loss, as one process computes them
    schedule = kind(stage, n_microbatches, loss_fn=lambda output, _target: loss_of(output), scale_grads=True)
    unused_targets = torch.zeros(n_microbatches, device=device)    # the schedule splits a target it never reads
    last = stage.num_stages - 1

    def step(micro_batches: list[Batch]) -> float:
        named = named_inputs(concatenate(micro_batches), signature, device)
        try:
            kwargs = {name: named[name] for name in model_inputs}
        except KeyError as exc:
            raise TensorOptError(f"pipeline stage {stage.stage_index} needs the model input {exc}, which the batch "
                                 "does not hold") from exc
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        schedule.step(target=unused_targets, losses=losses, return_outputs=False, **kwargs)
        sum_shared_gradients(reductions)
        optimizer.step()
        mean = torch.stack(losses).detach().float().mean() if stage.is_last else torch.zeros((), device=device)
        dist.broadcast(mean, src=last)                  # stage s runs on rank s
        return float(mean)
    return step


def sum_shared_gradients(reductions: list) -> None:
    """Sum each tied parameter's gradient over the stages holding a copy (a stage where it got no gradient
    contributes zeros), so every copy takes the step the one shared parameter would."""
    import torch.distributed as dist
    for param, group in reductions:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, group=group)
