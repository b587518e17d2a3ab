"""Tensor parallelism inside pipeline stages.

The stage modules ``torch.distributed.pipelining`` cuts are traced graphs (``torch.export`` unflattened into
``InterpreterModule``s). Their submodules are still called as modules (``call_module``), so module hooks fire,
but a linear is an ``InterpreterModule`` whose graph calls ``aten.linear`` on its ``weight`` and ``bias``:
torch's ``ColwiseParallel`` / ``RowwiseParallel`` shard ``nn.Linear`` only. So each linear the plan shards is
given back as an ``nn.Linear`` holding the very same parameters (after checking that its graph is exactly one
``aten.linear`` of its input), and the stage's block copies are then sharded by ``tensor_parallel.shard_copy``
as the un-piped engine shards the model. The ops between the linears were traced with the shapes the model
asked for: a model that takes head counts from its tensors (``view(b, s, -1, head_dim)``, which
``tensor_parallel`` requires anyway) is traced with that ``-1`` and runs on its rank's share of heads.

The vocabulary is split as plan.json's ``vocab_parallel`` says (``runtime.parallel.vocab_parallel``'s styles): the
embedding the first stage calls and the head the last stage calls are given back as ``nn.Embedding`` /
``nn.Linear`` in the same way, and the stepper runs the schedule under ``loss_parallel``.

Sequence parallelism (``sequence_parallel``): a stage's run of consecutive sequence-parallel copies of a block is
entered with the whole sequence (its first copy slices it) and left with it (its last copy gathers it), except at
a boundary between stages whose copies on both sides are sequence-parallel: there the stream crosses as each
rank's share, as Megatron-LM sends it (``sequence_parallel_boundaries``; the message's sequence dim divided by tp,
``shard_stream``). The ops the stage graph runs between its copies keep the shapes they were traced with, as
``cost.model.device_chain_sums`` prices each stage's chain (with virtual stages, each of a device's stages its
own). Inside a copy the stream is a ``DTensor`` sharded along the sequence: its global shape is the traced one,
so the shapes the trace fixed there (``view(b, s, ...)`` with ``s`` the whole sequence) still hold.

The sharded-versus-whole check (``tp_guard``) runs on the whole model before it is cut, on its original
block copies (sequence-parallel ones as such).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from ...errors import TensorOptError
from ...space.plan import BlockPlan, LayerStrategy
from ...space.run_plan import RunPlan
from ..blocks import copies_of
from ..parallel.sequence_parallel import FROM_MESSAGE
from ..parallel.tensor_parallel import check_degree, sharded_branches
from ..parallel.tp_guard import check_sharded_blocks
from ..parallel.tp_styles import shard_copy
from ..parallel.vocab_loss import cross_entropy_loss
from ..parallel.vocab_parallel import vocab_entry, vocab_styles


def check_before_cutting(model: nn.Module, run_plan: RunPlan, tp_mesh, device: torch.device, example_inputs) -> None:
    """``tp_guard`` on the uncut model's first copy of every sharded block (a one-line error if the sharded copy
    computes something else)."""
    first, sharded = {}, sharded_branches(run_plan)
    for block, branches in sharded.items():
        check_degree(block, branches, tp_mesh.size())
    for bp in run_plan.plan.blocks:
        if bp.block in sharded or any(_sequence_parallel(bp)):
            first[bp.block] = (copies_of(model, bp.block)[0], sharded.get(bp.block, ()))
    sp_layouts = {bp.block: run_plan.layout_of(bp.block) for bp in run_plan.plan.blocks if any(_sequence_parallel(bp))}
    check_sharded_blocks(model, example_inputs, first, tp_mesh, device, sp_layouts)


def shard_stage(stage_module: nn.Module, run_plan: RunPlan, tp_mesh, block_copies: Mapping[str, list[str]],
                stage: int = 0, boundaries: tuple[bool, bool] = (False, False)) -> None:
    """Shard, in place, the linears of every block copy this stage holds over ``tp_mesh``, and run the copies the
    plan marks sequence-parallel on the rank's share of the sequence within the stage (module doc).

    ``stage`` is the stage's index among all ``pp * virtual_stages``: the plan's strategies list a DEVICE's
    copies, and with virtual stages a device holds stages r, r + pp, ..., so a stage's copies are the slice
    ``(stage // pp) * size`` on of them (as ``recompute.recomputed_modules`` reads them). ``boundaries``: whether
    the stage receives, and hands on, the stream as the rank's share (``sequence_parallel_boundaries``).
    ``block_copies``: each block's copies in the uncut model (``stage_copies``): a block named by a slice of its
    pattern's matches (``layers.*[3:61]``) counts them among the whole model's, not the stage's."""
    sharded = sharded_branches(run_plan)
    held = {name for name, _ in stage_module.named_modules()}
    for bp in run_plan.plan.blocks:
        branches = sharded.get(bp.block, ())
        copies = [name for name in block_copies[bp.block] if name in held]
        first = (stage // run_plan.plan.pp) * len(copies)
        flags = _sequence_parallel(bp)[first:first + len(copies)]
        if len(copies) > len(flags):
            raise TensorOptError(f"a pipeline stage holds {len(copies)} copies of block {bp.block!r}, the plan "
                                 f"runs {len(flags)} per stage: re-plan with `tensoropt launch`")
        relay: dict = {}
        for j, name in enumerate(copies):
            copy = stage_module.get_submodule(name)
            for linear in {n for b in branches for n in b.linears}:
                _restore_linear(copy, linear, f"{name}.{linear}")
            # the stream is handed on as a share between consecutive SP copies of this stage, and across the
            # stage's boundaries where ``boundaries`` says so (a received share comes from no copy of this stage)
            enters = (j > 0 and flags[j - 1]) or (FROM_MESSAGE if j == 0 and boundaries[0] else False)
            handoff = (enters, (j + 1 < len(copies) and flags[j + 1]) or (j + 1 == len(copies) and boundaries[1]))
            if branches or flags[j]:
                shard_copy(copy, branches, tp_mesh, run_plan.layout_of(bp.block) if flags[j] else None, name,
                           handoff, relay, _stream_argument(copy, name) if flags[j] else None)


def stage_copies(model: nn.Module, run_plan: RunPlan) -> dict[str, list[str]]:
    """{block: its copies' module names} in the uncut ``model``, which the stage modules keep (``shard_stage``)."""
    return {bp.block: copies_of(model, bp.block) for bp in run_plan.plan.blocks}


def sequence_parallel_boundaries(plan, stage: int, streams: tuple[bool, bool]) -> tuple[bool, bool]:
    """(whether stage ``stage`` receives the stream as the rank's share of the sequence, whether it hands it on so):
    where the copies on both sides of a boundary between stages are sequence-parallel, the stream crosses it as
    each rank's ``s / tp`` share, as Megatron-LM sends it, instead of being gathered at the end of one stage and
    sliced at the start of the next. Only for a model of one block, whose messages at the boundary hold one
    stream (``streams``: at the stage's input and output boundaries, ``stream_message``); else the whole."""
    stages = plan.pp * plan.virtual_stages
    if plan.tp < 2 or len(plan.blocks) != 1:
        return False, False
    flags = _sequence_parallel(plan.blocks[0])
    size = len(flags) // plan.virtual_stages

    def flag(t: int, j: int) -> bool:
        return flags[(t // plan.pp) * size + j]
    enters = stage > 0 and streams[0] and flag(stage - 1, size - 1) and flag(stage, 0)
    leaves = stage < stages - 1 and streams[1] and flag(stage, size - 1) and flag(stage + 1, 0)
    return bool(enters), bool(leaves)


def stream_message(messages: tuple[torch.Tensor, ...], tp: int) -> int | None:
    """The position among a boundary's messages (meta tensors) of the stream: the one a gradient flows back through
    (relayed masks and tables need none), batch-first with a sequence ``tp`` divides; None unless exactly one."""
    streams = [i for i, m in enumerate(messages) if m.requires_grad]
    if len(streams) != 1 or messages[streams[0]].dim() < 3 or messages[streams[0]].shape[1] % tp:
        return None
    return streams[0]


def shard_stream(messages: tuple[torch.Tensor, ...], tp: int) -> tuple[torch.Tensor, ...]:
    """The boundary's messages with the stream as one rank's share of the sequence (dim 1 divided by ``tp``)."""
    index = stream_message(messages, tp)
    whole = messages[index]
    share = torch.empty((whole.shape[0], whole.shape[1] // tp, *whole.shape[2:]), dtype=whole.dtype, device="meta")
    return (*messages[:index], share.requires_grad_(True), *messages[index + 1:])


def _stream_argument(copy: nn.Module, name: str) -> int:
    """The position of the stream among a traced copy's arguments: the trace orders them its own way (a mask
    may come first), so it is the first floating-point argument shaped as the copy's output (a residual block
    returns its stream's shape)."""
    nodes = list(copy.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    result = nodes[-1].args[0]
    result = result[0] if isinstance(result, (tuple, list)) else result
    out = getattr(result, "meta", {}).get("val")
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor) and val.is_floating_point() \
                and val.shape == out.shape:
            return i
    raise TensorOptError(f"pipeline stage module {name} takes no argument shaped as its output, so sequence "
                         "parallelism cannot tell its stream: plan without sequence parallelism or with --pp 1")


def _per_copy(bp: BlockPlan) -> list[LayerStrategy]:
    """The strategy of each copy of the block on one stage, in order (strategies carry copy counts)."""
    return [s for s, n in bp.strategies for _ in range(n)]


def _sequence_parallel(bp: BlockPlan) -> list[bool]:
    return [s.sequence_parallel for s in _per_copy(bp)]


def shard_vocabulary(stage_module: nn.Module, run_plan: RunPlan, tp_mesh) -> bool:
    """Split the vocabulary as plan.json says (``vocab_parallel``) in the modules this stage calls: the embedding
    on the first stage, the head on the last (a stage holding a tied one's weight without calling it gets the
    sharded parameter, so the tie survives). Whether this stage computes its loss on sharded logits."""
    entry = vocab_entry(run_plan)
    if not entry.enabled:
        return False
    called = {n.target for n in stage_module.graph.nodes if n.op == "call_module"}
    embed_style, head_style = vocab_styles()
    split = False
    for name, kind, style in ((entry.embedding, nn.Embedding, embed_style), (entry.head, nn.Linear, head_style)):
        if name not in called:
            continue
        module = _restore(stage_module, name, name, kind)
        if module.weight.shape[0] != entry.vocab or entry.vocab % tp_mesh.size():
            raise TensorOptError(f"{name} holds {module.weight.shape[0]} vocabulary rows, the plan splits "
                                 f"{entry.vocab} over {tp_mesh.size()} devices: re-plan with `tensoropt launch`")
        parallelize_module(module, tp_mesh, style)
        if entry.tied:
            other = entry.head if name == entry.embedding else entry.embedding
            if _holds(stage_module, other):
                stage_module.get_submodule(other).weight = module.weight
        split |= kind is nn.Linear
    if split:
        _drop_metadata_asserts(stage_module)
        route_cross_entropy(stage_module)
    return split


def _drop_metadata_asserts(stage_module: nn.Module) -> None:
    """Remove the trace's dtype/device checks on tensors (``aten._assert_tensor_metadata``, recorded for the
    logits' ``.float()``): DTensor has no sharding rule for them, and they compute nothing."""
    graph = stage_module.graph
    asserts = [n for n in graph.nodes if n.op == "call_function"
               and n.target is torch.ops.aten._assert_tensor_metadata.default and not n.users]
    for node in asserts:
        graph.erase_node(node)
    if asserts:
        stage_module.recompile()


def route_cross_entropy(stage_module: nn.Module) -> None:
    """The trace records ``F.cross_entropy`` as the aten op it calls; call it through the Python entry point
    instead (``vocab_loss.cross_entropy_loss``, the same arguments), which the step's loss context routes to the
    lean loss (split, or whole under ``RunPlan.lean_loss``), as in the model run whole."""
    calls = [n for n in stage_module.graph.nodes if n.op == "call_function"
             and n.target is torch.ops.aten.cross_entropy_loss.default]
    for node in calls:
        node.target = cross_entropy_loss
    if calls:
        stage_module.recompile()


def _holds(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _restore_linear(copy: nn.Module, name: str, full_name: str) -> None:
    _restore(copy, name, full_name, nn.Linear)


def _restore(owner_module: nn.Module, name: str, full_name: str, kind: type) -> nn.Module:
    """Replace the traced ``name`` of ``owner_module`` (one ``aten.linear`` or ``aten.embedding`` on its weight)
    by an ``nn.Linear`` / ``nn.Embedding`` over the same parameters; returns it."""
    traced = owner_module.get_submodule(name)
    if isinstance(traced, kind):
        return traced
    op = torch.ops.aten.linear.default if kind is nn.Linear else torch.ops.aten.embedding.default
    calls = [n for n in getattr(traced, "graph", torch.fx.Graph()).nodes if n.op == "call_function"]
    weight, bias = traced._parameters.get("weight"), traced._parameters.get("bias")
    plain = kind is nn.Linear or (len(calls) == 1 and len(calls[0].args) == 2 and not bias)
    if len(calls) != 1 or calls[0].target is not op or weight is None or weight.dim() != 2 or not plain:
        raise TensorOptError(f"pipeline stage module {full_name} is not one {op.__name__.split('.')[0]} on its weight "
                             "after tracing, so tensor parallelism cannot shard it inside a pipeline: plan with --tp 1 "
                             "or --pp 1")
    if kind is nn.Linear:
        module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
        if bias is not None:
            module.bias = bias
    else:
        module = nn.Embedding(weight.shape[0], weight.shape[1], device="meta", dtype=weight.dtype)
    module.weight = weight
    owner, _, attr = name.rpartition(".")
    setattr(owner_module.get_submodule(owner) if owner else owner_module, attr, module)
    return module


__all__ = ["check_before_cutting", "route_cross_entropy", "sequence_parallel_boundaries", "shard_stage", "shard_stream",
           "shard_vocabulary", "stage_copies", "stream_message"]
