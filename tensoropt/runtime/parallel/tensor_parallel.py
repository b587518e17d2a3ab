"""Tensor parallelism for the torch engine: Megatron-LM's layout with ``torch.distributed.tensor``.

In every copy of the plan's blocks, each branch the plan shards (``Plan.tp_branches``, the planner's
branch names) gets ``ColwiseParallel`` on its first linears (attention QKV or q/k/v projections, MLP
up/gate: weight split by output features, the input replicated) and ``RowwiseParallel`` on its output
linears (attention output projection, MLP down: weight split by input features, the partial outputs
summed by one all-reduce). The ops between them run on the rank's share of heads or features, so a
model must take head counts from its tensors (``view(b, s, -1, head_dim)``), as Hugging Face models and
``tensoropt.models.transformer`` do. Norms and the residual stream are replicated; the vocabulary, below.

Which modules those linears are comes from plan.json's ``tp_layout`` (see ``tensoropt.space.tp_layout``),
which the launcher derives from the captured graph's block analysis: the runtime shards exactly what the
cost model assumed, and never guesses from module names.

The vocabulary (embedding, LM head and the cross-entropy on the logits) is split over the same ranks where
plan.json's ``vocab_parallel`` says the model allows it (``runtime.parallel.vocab_parallel``), and stays replicated,
as it was priced, where it does not. Copies the plan runs sequence-parallel are set up by
``sequence_parallel``.
"""

from __future__ import annotations

from torch import nn

from ...errors import TensorOptError
from ...space.run_plan import Branches, RunPlan
from ...space.tp_layout import TP_LAYOUT_KEY
from ..blocks import copies_of
from .sequence_parallel import sequence_parallel_copies
from .tp_guard import check_sharded_blocks
from .tp_styles import shard_copy
from .vocab_parallel import apply_vocab_parallel


def apply_tensor_parallel(model: nn.Module, run_plan: RunPlan, tp_mesh, device, example_inputs=None) -> bool:
    """Shard, in place, the linears of the plan's tensor-parallel branches over ``tp_mesh`` (and run the copies
    the plan marks sequence-parallel on the rank's share of the sequence, ``sequence_parallel``), after checking
    on a small real input that the sharded blocks compute what the whole ones do (``tp_guard``), and the
    vocabulary where the plan splits it; returns whether it did (the step then computes the loss under
    ``loss_parallel``, ``vocab_parallel.loss_context``)."""
    tp = tp_mesh.size()
    sp = sequence_parallel_copies(model, run_plan.plan)
    blocks: dict[str, tuple[list[str], Branches]] = {}
    for block, branches in sharded_branches(run_plan).items():
        check_degree(block, branches, tp)
        copies = copies_of(model, block)
        if not copies:
            raise TensorOptError(f"the plan shards block {block!r} over {tp} devices, but no module of this model "
                                 "matches that name: the plan was made for another model")
        for name in copies:
            check_linears(model.get_submodule(name), name, branches, tp)
        blocks[block] = (copies, branches)
    for bp in run_plan.plan.blocks:      # sequence-parallel copies of a block none of whose branches is sharded
        copies = copies_of(model, bp.block)
        if bp.block not in blocks and any(c in sp for c in copies):
            blocks[bp.block] = (copies, ())
    if example_inputs is not None:
        check_sharded_blocks(model, example_inputs, {b: (c[0], br) for b, (c, br) in blocks.items()}, tp_mesh,
                             device, {b: run_plan.layout_of(b) for b, (c, _) in blocks.items() if c[0] in sp})
    for block, (copies, branches) in blocks.items():
        relay: dict = {}
        for name in copies:
            shard_copy(model.get_submodule(name), branches, tp_mesh, run_plan.layout_of(block) if name in sp else None,
                       name, sp.get(name, (False, False)), relay)
    return apply_vocab_parallel(model, run_plan, tp_mesh)


def sharded_branches(run_plan: RunPlan) -> dict[str, Branches]:
    """{block pattern: its branches that the plan shards}, from plan.json's ``tp_layout``."""
    plan = run_plan.plan
    if run_plan.tp_layout is None:
        raise TensorOptError(f"plan {plan.summary()} asks for tensor parallelism but its plan.json has no "
                             f"'{TP_LAYOUT_KEY}' (which linears to shard): start the workers with `tensoropt launch`, "
                             "which writes it")
    chosen = set(plan.tp_branches)
    out = {}
    for bp in plan.blocks:
        branches = tuple(b for b in run_plan.layout_of(bp.block) if b.branch in chosen)
        if branches:
            out[bp.block] = branches
    if chosen and not out:
        raise TensorOptError(f"plan {plan.summary()} shards branches {sorted(chosen)}, but its '{TP_LAYOUT_KEY}' has "
                             "none of them: the plan was made for another model")
    return out


def check_degree(block: str, branches: Branches, tp: int) -> None:
    """Refuse a degree that would split a head or a feature group (a hand-edited plan; the planner
    never proposes one): the ranks' shares would not be whole heads and results would be wrong."""
    for branch in branches:
        if branch.max_tp % tp:
            raise TensorOptError(f"tensor parallelism over {tp} devices splits the heads or features of branch "
                                 f"{branch.branch!r} in block {block!r}: tp must divide {branch.max_tp}")


def check_linears(copy: nn.Module, copy_name: str, branches: Branches, tp: int) -> None:
    """Every module to shard must be an ``nn.Linear`` or a ``Conv1D`` whose sharded features (each segment's, for a
    fused projection) ``tp`` divides: ``parallelize_module`` would otherwise fail deep inside DTensor, or shard
    unevenly."""
    from ...space.tp_check import linear_kind
    for branch in branches:
        for name, role in [(n, "column") for n in branch.column] + [(n, "row") for n in branch.row]:
            try:
                module = copy.get_submodule(name)
            except AttributeError:
                raise TensorOptError(f"{copy_name} has no module {name!r} to shard: the plan was made for another "
                                     "model") from None
            kind = linear_kind(module)
            if kind is None:
                raise TensorOptError(f"tensor parallelism shards nn.Linear and Conv1D modules, but {copy_name}.{name} "
                                     f"is a {type(module).__name__}: plan this model with --tp 1")
            out_dim, in_dim = (1, 0) if kind == "conv1d" else (0, 1)
            features = module.weight.shape[out_dim if role == "column" else in_dim]
            fused = branch.segments_of(name) if role == "column" else None
            parts = fused if fused is not None else (features,)
            if sum(parts) != features or any(p % tp for p in parts):
                raise TensorOptError(f"{copy_name}.{name} has {features} features ({'+'.join(map(str, parts))}), "
                                     f"which do not split over {tp} tensor-parallel devices")


__all__ = ["apply_tensor_parallel", "sharded_branches"]
