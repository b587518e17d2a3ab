"""Pipeline stages for the torch engine, composed with data and tensor parallelism.

The devices form one mesh with named dimensions ``("pp", "dp", "tp")`` (pipeline outermost, tensor
parallelism innermost, as torchtitan lays it out): the ranks of one (dp, tp) coordinate form one pipeline,
those of one (pp, tp) coordinate hold the same stages and average their gradients, those of one (pp, dp)
coordinate split their stages' block copies, embedding and head by Megatron-LM's layout (``pipeline_tp``).
The model is cut into ``pp * virtual_stages`` stages by ``torch.distributed.pipelining``'s tracer
(``pipeline_split``); pipeline rank ``r`` holds stages ``r, r + pp, ...`` (one with plain 1F1B, several with
interleaved 1F1B, Narayanan et al. 2021, https://arxiv.org/abs/2104.04473) and runs them with this project's
own schedule executor (``pipeline_executor``, on the schedule ``space.pipeline_schedule`` gives, which the cost
model prices): what a device holds for its messages is bounded by what is in flight, not by the step's
micro-batches.

Each stage is set up as the whole model is (``torch_engine``), in the same order: tensor parallelism,
recomputation and compilation of its block copies, then FSDP2 (ZeRO 1-3: ``data_parallel.data_parallel_stage``,
over the tensor-parallel shards where tp > 1: 2-D DTensors), all on the meta device for a meta-built model, and
only then placement (``materialize.place``): a stage gets storage for its shards only, never for its whole
parameters. Under ZeRO 0 it is then wrapped in DDP over the ``dp`` group.

Parameters used on several stages (tied input and output embeddings) are copied onto each stage by the
split; their gradients are summed over those stages (on this rank, then over the pipeline ranks that hold
them, within one (dp, tp) coordinate) before the optimizer step, so the copies take identical steps and
stay equal, as the one shared parameter of the unsplit model would.

Each stage knows the shapes of what it receives and sends from the trace (``pipeline_split.stage_messages``), so
no stage asks another for shapes and the first step allocates as every later one; a simulation on a fake process
group (``memory_check``), whose messages carry nothing, runs the same executor.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch
from torch import nn

from ...errors import TensorOptError
from ...search.engines import computes_with_bf16_weights
from ...space.pipeline_schedule import check, device_steps
from ...space.run_plan import RunPlan
from ..blocks import replace_module
from ..device import local_tensor, to_device
from ..engines.compile import apply_compile, compiled_modules
from ..engines.param_groups import build_optimizer
from ..engines.precision import autocast_forward
from ..engines.precision_names import of_plan
from ..memory.materialize import Materializer, place, tied_parameters
from ..memory.recompute import recompute_wrappers
from ..parallel.data_parallel import data_parallel_stage, replicate
from ..parallel.vocab_parallel import LossContext, loss_context
from ..run import Batch, Run, Stepper, loss_of
from .executor import StageRunner, run_schedule
from .split import (
    Relay,
    example_micro_batch,
    keep_out_of_state_dict,
    retarget_devices,
    saved_buffers,
    split_spec,
    stage_messages,
    stage_wiring,
    tie_within_stage,
)
from .tp import (
    check_before_cutting,
    route_cross_entropy,
    sequence_parallel_boundaries,
    shard_stage,
    shard_stream,
    shard_vocabulary,
    stage_copies,
    stream_message,
)
from .trace import trace_pipeline


def apply_pipeline(model: nn.Module, optimizer_fn: Callable[[object], torch.optim.Optimizer] | None,
                   run_plan: RunPlan, device: torch.device, materializer: Materializer | None = None,
                   example_inputs: Batch | None = None) -> tuple[nn.Module, object, Run]:
    """Cut ``model`` into the plan's stages and return this rank's (stage module, optimizer, Run): one stage
    module, or a ``merged_view`` of them with virtual stages. Only this rank's stages are put on ``device``, each
    once it is sharded (a meta-built model: only their shards get storage)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if example_inputs is None:
        raise TensorOptError("pipeline stages are cut by tracing one micro-batch: pass example_inputs to "
                             "tensoropt.parallelize")
    plan = run_plan.plan
    pp, dp, tp, virtual = plan.pp, plan.dp, plan.tp, plan.virtual_stages
    try:
        check(pp, virtual, plan.grad_accumulation)
    except ValueError as exc:
        raise TensorOptError(f"plan {plan.summary()}: {exc}") from None
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, n_stages = mesh.get_local_rank("pp"), mesh.get_local_rank("dp"), pp * virtual
    mine = [pp_rank + k * pp for k in range(virtual)]
    tied, recomputed = tied_parameters(model), recompute_wrappers(model, plan)
    saved = saved_buffers(model)
    compiled = set(compiled_modules(model, plan))
    signature = inspect.signature(model.forward)
    block_copies = stage_copies(model, run_plan)
    if tp > 1:
        check_before_cutting(model, run_plan, mesh["tp"], device, example_inputs)
    if materializer is not None:        # a meta-built model is cut on meta, buffers too (their values are kept)
        _to_meta(model)
    trace_device = next(iter(model.parameters())).device
    args, kwargs = to_device(example_micro_batch(example_inputs, plan.micro_batch), trace_device)
    # bf16-mixed: the stages' graphs compute in bf16 (a meta-built model is traced on fake CPU tensors), with bf16
    # weights where FSDP2 gathers them so (pipeline_trace)
    bf16_weights = computes_with_bf16_weights("torch", plan.zero, plan.pp, of_plan(plan))
    pipe = trace_pipeline(model, args, kwargs, split_spec(model, plan), of_plan(plan), bf16_weights)
    if pipe.num_stages != n_stages:
        raise TensorOptError(f"cutting the model before its block copies gave {pipe.num_stages} pipeline stages, "
                             f"the plan has {n_stages}: every block copy must be called once by the model's forward")
    held = [{name for name, _ in pipe.get_stage_module(s).named_parameters(remove_duplicate=False)}
            for s in range(n_stages)]
    modules, runners, shared, vocab_split, inputs = [], {}, {}, False, {}
    for s in mine:
        module = pipe.get_stage_module(s)
        retarget_devices(module, device)            # before recomputation wraps the blocks' graphs
        keep_out_of_state_dict(module, saved)
        shared[s] = tie_within_stage(module, tied, held[s])
        received, sent = stage_messages(pipe, s)
        boundaries = sequence_parallel_boundaries(plan, s, (stream_message(received, tp) is not None,
                                                            stream_message(sent, tp) is not None))
        received, sent = (shard_stream(received, tp) if boundaries[0] else received,
                          shard_stream(sent, tp) if boundaries[1] else sent)
        if tp > 1:                                  # before recomputation wraps the copies
            shard_stage(module, run_plan, mesh["tp"], block_copies, s, boundaries)
            vocab_split |= shard_vocabulary(module, run_plan, mesh["tp"])
        if run_plan.lean_loss:                      # the loss on whole logits runs lean too (vocab_loss)
            route_cross_entropy(module)
        names = {n for n, _ in module.named_modules()}
        for name in sorted(recomputed.keys() & names):
            replace_module(module, name, recomputed[name])
        apply_compile(module, plan, sorted(compiled & names))      # around the recomputed copy, as torch_engine
        wiring = stage_wiring(pipe.split_gm.graph, s)
        relay = Relay(module, wiring)
        autocast_forward(relay, of_plan(plan), device)             # it runs under the autocast it was traced in
        before_backward = data_parallel_stage(module, plan, mesh["dp"])
        # only now storage, for this rank's shards. Materialising replays the model's construction from the
        # generator's state; every stage of this rank starts from the same one, and the last leaves the
        # generator where the model built for real would have
        with torch.random.fork_rng(_rng_devices(device), enabled=materializer is not None and s != mine[-1],
                                   device_type=device.type):
            place(module, device, materializer)
        runner_module = replicate(relay, device, mesh["dp"].get_group()) if plan.zero == 0 and dp > 1 else relay
        runners[s] = StageRunner(runner_module, s, n_stages, received, sent, device, before_backward)
        inputs.update(dict.fromkeys(wiring.model_inputs))
        modules.append(module)
    del pipe                                        # the other stages' modules go with it
    # FSDP2 and placement replaced the parameters: the tied ones are looked up again by name
    shared = {s: {index: module.get_parameter(next(n for n in tied[index] if n in held[s])) for index in by_index}
              for (s, by_index), module in zip(sorted(shared.items()), modules)}
    reductions = shared_gradient_groups(shared, tied, held, mesh)
    optimizer = build_optimizer(optimizer_fn, [p for m in modules for p in m.parameters()])
    stepper = None
    if optimizer is not None:
        steps = device_steps(pp_rank, pp, virtual, plan.grad_accumulation)
        stepper = pipeline_stepper(runners, steps, optimizer, signature, tuple(inputs), reductions, dp * tp,
                                   loss_context(vocab_split, run_plan.lean_loss), device, mesh["pp"].get_group())
    run = Run(dist.get_rank(), dist.get_world_size(), dp_rank, dp, plan.micro_batch, plan.grad_accumulation,
              plan.global_batch, run_plan, "torch", stepper, device=device, pipeline_group=mesh["pp"].get_group())
    return (modules[0] if virtual == 1 else merged_view(modules)), optimizer, run


def _to_meta(model: nn.Module) -> None:
    """Every parameter and buffer of ``model`` not on meta moved there, a tied one once (``Module._apply`` would also
    convert what is on meta already; under the memory simulation's ``FakeTensorMode`` it then swaps each tensor with
    its own conversion, which fails for a parameter registered under two names)."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            slots = getattr(module, kind)
            for name, tensor in list(slots.items()):
                if tensor is None or tensor.is_meta:
                    continue
                if id(tensor) not in moved:
                    meta = tensor.detach().to("meta")
                    moved[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) \
                        if isinstance(tensor, nn.Parameter) else meta
                slots[name] = moved[id(tensor)]


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


def pipeline_stepper(runners: dict[int, StageRunner], steps: tuple, optimizer: torch.optim.Optimizer,
                     signature: inspect.Signature, model_inputs: tuple[str, ...], reductions: list, copies: int,
                     loss_context: LossContext, device: torch.device, pp_group) -> Stepper:
    """The Run's stepper: this device's schedule over its micro-batches (``pipeline_executor``), tied gradients
    summed over their stages, one optimizer step; returns the step's mean loss: each pipeline's last stage has
    its replica's mean (each of its tensor-parallel ranks the same one), summed over the world (the other ranks
    add zeros) and divided by ``copies``, the number of last-stage ranks (dp x tp)."""
    import torch.distributed as dist

    def inputs_of(micro: Batch) -> dict[str, object]:
        named = named_inputs(micro, signature, device)
        try:
            return {name: named[name] for name in model_inputs}
        except KeyError as exc:
            raise TensorOptError(f"pipeline stages {sorted(runners)} need the model input {exc}, which the batch "
                                 "does not hold") from exc

    def step(micro_batches: list[Batch]) -> torch.Tensor:
        kwargs = [inputs_of(micro) for micro in micro_batches]
        optimizer.zero_grad(set_to_none=True)
        with loss_context():                # the logits sharded by vocabulary: forwards and backwards under it
            losses = run_schedule(steps, runners, kwargs, loss_of, pp_group)
        sum_shared_gradients(reductions)
        optimizer.step()
        mean = torch.stack(losses).float().mean() if losses else torch.zeros((), device=device)
        dist.all_reduce(mean)
        return mean / copies
    return step
