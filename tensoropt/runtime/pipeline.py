"""Pipeline stages for the torch engine, with ``torch.distributed.pipelining``, composed with data and tensor
parallelism.

The devices form one mesh with named dimensions ``("pp", "dp", "tp")`` (pipeline outermost, tensor
parallelism innermost, as torchtitan lays it out): the ranks of one (dp, tp) coordinate form one pipeline,
those of one (pp, tp) coordinate hold the same stages and average their gradients, those of one (pp, dp)
coordinate split their stages' block copies, embedding and head by Megatron-LM's layout (``pipeline_tp``).
The model is cut into ``pp * virtual_stages`` stages (``pipeline_split``); pipeline rank ``r`` holds
stages ``r, r + pp, ...`` (one with plain 1F1B, several with interleaved 1F1B, Narayanan et al. 2021,
https://arxiv.org/abs/2104.04473). Each stage is wrapped for data parallelism over the ``dp`` group by
``data_parallel.data_parallel_stage`` (DDP under ZeRO 0, FSDP2 under ZeRO 1-3, as the un-piped engine runs
them, over the tensor-parallel shards where tp > 1: 2-D DTensors, as FSDP2 composes with tensor parallelism).

Parameters used on several stages (tied input and output embeddings) are copied onto each stage by the
split; their gradients are summed over those stages (on this rank, then over the pipeline ranks that hold
them, within one (dp, tp) coordinate) before the optimizer step, so the copies take identical steps and
stay equal, as the one shared parameter of the unsplit model would.

Each ``PipelineStage`` is built with the shapes of what it receives and sends (``pipeline_split.stage_messages``,
from the trace), so the schedule's first step runs no shape-inference forward and backward and no stage sends
another its shapes (torch's "static" metadata mode): the first step allocates as every later one, and a
simulation on a fake process group (``memory_check``), whose messages carry nothing, runs the same schedule.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from ..errors import TensorOptError
from ..space.run_plan import RunPlan
from .blocks import replace_module
from .compile import apply_compile, compiled_modules
from .data_parallel import data_parallel_stage, reshard_all
from .device import local_tensor, to_device
from .materialize import Materializer, place, tied_parameters
from .param_groups import build_optimizer
from .pipeline_split import (
    Relay,
    example_micro_batch,
    retarget_devices,
    split_spec,
    stage_messages,
    stage_wiring,
    tie_within_stage,
)
from .pipeline_tp import check_before_cutting, shard_stage, shard_vocabulary
from .pipeline_trace import trace_pipeline
from .precision import autocast_forward, of_plan
from .recompute import recompute_wrappers
from .run import Batch, Run, Stepper, loss_of
from .vocab_parallel import LossContext, loss_context


def apply_pipeline(model: nn.Module, optimizer_fn: Callable[[object], torch.optim.Optimizer] | None,
                   run_plan: RunPlan, device: torch.device, materializer: Materializer | None = None,
                   example_inputs: Batch | None = None) -> tuple[nn.Module, object, Run]:
    """Cut ``model`` into the plan's stages and return this rank's (stage module, optimizer, Run): one stage
    module, or a ``merged_view`` of them with virtual stages. Only this rank's stages are put on
    ``device`` (a meta-built model: only they get storage)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if example_inputs is None:
        raise TensorOptError("pipeline stages are cut by tracing one micro-batch: pass example_inputs to "
                             "tensoropt.parallelize")
    plan = run_plan.plan
    pp, dp, tp, virtual = plan.pp, plan.dp, plan.tp, plan.virtual_stages
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, n_stages = mesh.get_local_rank("pp"), mesh.get_local_rank("dp"), pp * virtual
    mine = [pp_rank + k * pp for k in range(virtual)]
    tied, recomputed = tied_parameters(model), recompute_wrappers(model, plan)
    compiled = set(compiled_modules(model, plan))
    signature = inspect.signature(model.forward)
    if tp > 1:
        check_before_cutting(model, run_plan, mesh["tp"], device, example_inputs)
    if materializer is not None:        # a meta-built model is cut on meta, buffers too (their values are kept)
        model._apply(lambda t: t.to("meta"))
    trace_device = next(iter(model.parameters())).device
    args, kwargs = to_device(example_micro_batch(example_inputs, plan.micro_batch), trace_device)
    # bf16-mixed: the stages' graphs compute in bf16 (a meta-built model is traced on fake CPU tensors)
    pipe = trace_pipeline(model, args, kwargs, split_spec(model, plan), of_plan(plan))
    if pipe.num_stages != n_stages:
        raise TensorOptError(f"cutting the model before its block copies gave {pipe.num_stages} pipeline stages, "
                             f"the plan has {n_stages}: every block copy must be called once by the model's forward")
    held = [{name for name, _ in pipe.get_stage_module(s).named_parameters(remove_duplicate=False)}
            for s in range(n_stages)]
    modules, wirings, messages, shared, vocab_split = [], [], [], {}, False
    for s in mine:
        module = pipe.get_stage_module(s)
        retarget_devices(module, device)            # before recomputation wraps the blocks' graphs
        # before tying: a meta-built stage gets new parameters. Materialising replays the model's construction
        # from the generator's state; every stage of this rank starts from the same one, and the last leaves
        # the generator where the model built for real would have
        with torch.random.fork_rng(_rng_devices(device), enabled=materializer is not None and s != mine[-1],
                                   device_type=device.type):
            place(module, device, materializer)
        shared[s] = tie_within_stage(module, tied, held[s])
        if tp > 1:                                  # before recomputation wraps the copies
            shard_stage(module, run_plan, mesh["tp"], s)
            vocab_split |= shard_vocabulary(module, run_plan, mesh["tp"])
        names = {n for n, _ in module.named_modules()}
        for name in sorted(recomputed.keys() & names):
            replace_module(module, name, recomputed[name])
        apply_compile(module, plan, sorted(compiled & names))      # around the recomputed copy, as torch_engine
        modules.append(module)
        wirings.append(stage_wiring(pipe.split_gm.graph, s))
        messages.append(stage_messages(pipe, s))
    del pipe                                        # the other stages' modules go with it
    relays = [Relay(m, w) for m, w in zip(modules, wirings)]
    for relay in relays:                            # and run under the autocast they were traced in
        autocast_forward(relay, of_plan(plan), device)
    wrapped = [data_parallel_stage(relay, plan, mesh["dp"], device) for relay in relays]
    # FSDP2 replaced the parameters with sharded ones: the tied ones are looked up again by name
    shared = {s: {index: module.get_parameter(next(n for n in tied[index] if n in held[s])) for index in by_index}
              for (s, by_index), module in zip(sorted(shared.items()), modules)}
    reductions = shared_gradient_groups(shared, tied, held, mesh)
    # every stage is given its messages' shapes up front: no stage asks another (module doc)
    stages = [PipelineStage(w, s, n_stages, device, input_args=received, output_args=sent, group=mesh["pp"].get_group())
              for w, s, (received, sent) in zip(wrapped, mine, messages)]
    optimizer = build_optimizer(optimizer_fn, [p for m in modules for p in m.parameters()])
    stepper = None
    if optimizer is not None:
        inputs = tuple(dict.fromkeys(name for w in wirings for name in w.model_inputs))
        after_schedule = reshard_all(modules) if plan.zero == 2 else None
        stepper = pipeline_stepper(stages, plan.grad_accumulation, optimizer, signature, inputs, reductions,
                                   after_schedule, dp * tp, loss_context(vocab_split), device)
    run = Run(dist.get_rank(), dist.get_world_size(), dp_rank, dp, plan.micro_batch, plan.grad_accumulation,
              plan.global_batch, run_plan, "torch", stepper, device=device)
    return (modules[0] if virtual == 1 else merged_view(modules)), optimizer, run


def merged_view(modules: list[nn.Module]) -> nn.Module:
    """One module holding the parameters and buffers of several stage modules under the model's own names
    (``layers.0`` from one stage, ``layers.2`` from another): what a script gets back with virtual stages, for
    its parameters, state dict and optimizer, not to be called (the schedule runs the stages)."""
    view = nn.Module()
    for module in modules:
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                getattr(view, kind).setdefault(name, tensor)
    children: dict[str, list[nn.Module]] = {}
    for module in modules:
        for name, child in module._modules.items():
            if child is not None:
                children.setdefault(name, []).append(child)
    for name, group in children.items():
        view.add_module(name, group[0] if len(group) == 1 else merged_view(group))
    return view


def _rng_devices(device: torch.device) -> list[int]:
    """The accelerator generators ``fork_rng`` saves besides the CPU's: this rank's device's."""
    return [device.index] if device.type != "cpu" and device.index is not None else []


def shared_gradient_groups(shared: dict[int, dict[int, nn.Parameter]], tied: list[tuple[str, ...]],
                           held: list[set[str]], mesh) -> list[tuple[list[nn.Parameter], object]]:
    """(this rank's copies, process group over the pipeline ranks holding one) for each tied parameter held by
    several stages; the group is None when only this rank holds them. ``shared``: {stage: {tied group index:
    parameter}} for this rank's stages. Every rank creates the same groups in the same order, as
    ``new_group`` requires: one per (dp, tp) coordinate, the ranks of one pipeline."""
    import torch.distributed as dist
    pp = mesh["pp"].size()
    # one column per (dp, tp) coordinate: the ranks of one pipeline. Read as Python lists (a tensor op on the
    # mesh's table would give a fake tensor in a simulation, see memory_check)
    columns = [[rank for tp_ranks in dp_rows for rank in tp_ranks] for dp_rows in mesh.mesh.tolist()]
    mine = next(row.index(dist.get_rank()) for row in columns if dist.get_rank() in row)
    out, groups = [], {}
    for index, group in enumerate(tied):
        stages = [s for s, names in enumerate(held) if any(name in names for name in group)]
        if len(stages) < 2:
            continue
        ranks = tuple(sorted({s % pp for s in stages}))
        if len(ranks) > 1 and ranks not in groups:
            groups[ranks] = mesh["pp"].get_group() if len(ranks) == pp else \
                [dist.new_group([columns[r][c] for r in ranks]) for c in range(len(columns[0]))][mine]
        params = [by_index[index] for _, by_index in sorted(shared.items()) if index in by_index]
        if params:
            out.append((params, groups.get(ranks)))
    return out


def sum_shared_gradients(reductions: list) -> None:
    """Sum each tied parameter's gradient over the stages holding a copy (a stage where it got no gradient
    contributes zeros), so every copy takes the step the one shared parameter would. Sharded copies (FSDP2)
    are sharded alike on every pipeline rank, so their local shards are summed."""
    import torch.distributed as dist
    for params, group in reductions:
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            elif getattr(param.grad, "placements", None) != getattr(param, "placements", None):
                # a vocabulary-split embedding's gradient comes back replicated: laid out as its parameter
                # (a local slice), so every stage's copy sums the same rows
                param.grad = param.grad.redistribute(param.device_mesh, param.placements)
        grads = [local_tensor(param.grad) for param in params]
        total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
        if group is not None:
            dist.all_reduce(total, group=group)
        for grad in grads:
            if grad is not total:
                grad.copy_(total)


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


def make_schedule(stages: list, n_microbatches: int):
    """Interleaved 1F1B for several stages per rank; else 1F1B (what the cost model assumes), or GPipe when
    there are fewer micro-batches than stages, which 1F1B does not run. The model's forward returns each
    micro-batch's mean loss; ``scale_grads`` divides the summed gradients by the number of micro-batches: the
    gradients of the step's mean loss, as one process computes them."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    def loss_fn(output, _target):
        return loss_of(output)
    if len(stages) > 1:
        try:
            return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=True)
        except ValueError as exc:       # the micro-batches do not fill its rounds
            raise TensorOptError(f"interleaved 1F1B cannot run {n_microbatches} micro-batches over "
                                 f"{stages[0].group_size} pipeline ranks: {exc}") from exc
    kind = Schedule1F1B if n_microbatches >= stages[0].num_stages else ScheduleGPipe
    return kind(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=True)


def pipeline_stepper(stages: list, n_microbatches: int, optimizer: torch.optim.Optimizer,
                     signature: inspect.Signature, model_inputs: tuple[str, ...], reductions: list,
                     after_schedule: Callable[[], None] | None, copies: int, loss_context: LossContext,
                     device: torch.device) -> Stepper:
    """The Run's stepper: one schedule step over this rank's micro-batches, tied gradients summed over their
    stages, one optimizer step; returns the step's mean loss: each pipeline's last stage has its replica's
    mean (each of its tensor-parallel ranks the same one), summed over the world (the other ranks add zeros) and
    divided by ``copies``, the number of last-stage ranks (dp x tp)."""
    import torch.distributed as dist
    schedule = make_schedule(stages, n_microbatches)
    unused_targets = torch.zeros(n_microbatches, device=device)    # the schedule splits a target it never reads
    is_last = any(stage.is_last for stage in stages)

    def step(micro_batches: list[Batch]) -> float:
        named = named_inputs(concatenate(micro_batches), signature, device)
        try:
            kwargs = {name: named[name] for name in model_inputs}
        except KeyError as exc:
            raise TensorOptError(f"pipeline stages {[s.stage_index for s in stages]} need the model input {exc}, "
                                 "which the batch does not hold") from exc
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        with loss_context():                # the logits sharded by vocabulary: forwards and backwards under it
            schedule.step(target=unused_targets, losses=losses, return_outputs=False, **kwargs)
        if after_schedule is not None:
            after_schedule()
        sum_shared_gradients(reductions)
        optimizer.step()
        mean = torch.stack([local_tensor(loss) for loss in losses]).detach().float().mean() if is_last \
            else torch.zeros((), device=device)
        dist.all_reduce(mean)
        return float(mean) / copies
    return step
