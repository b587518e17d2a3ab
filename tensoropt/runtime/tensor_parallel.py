"""Tensor parallelism for the torch engine: Megatron-LM's layout with ``torch.distributed.tensor``.

In every copy of the plan's blocks, each branch the plan shards (``plan["tp_branches"]``, the planner's
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
plan.json's ``vocab_parallel`` says the model allows it (``runtime.vocab_parallel``), and stays replicated,
as it was priced, where it does not. Copies the plan runs sequence-parallel are set up by
``sequence_parallel``.
"""

from __future__ import annotations

from torch import nn

from ..errors import TensorOptError
from ..space.tp_layout import TP_LAYOUT_KEY
from .sequence_parallel import apply_sequence_parallel, layout_of, sequence_parallel_copies
from .torch_engine import block_modules
from .vocab_parallel import apply_vocab_parallel


def apply_tensor_parallel(model: nn.Module, plan: dict, tp_mesh, device, example_inputs=None) -> bool:
    """Shard, in place, the linears of the plan's tensor-parallel branches over ``tp_mesh`` (and run the copies
    the plan marks sequence-parallel on the rank's share of the sequence, ``sequence_parallel``), after checking
    on a small real input that the sharded blocks compute what the whole ones do (``tp_guard``), and the
    vocabulary where the plan splits it; returns whether it did (the step then computes the loss under
    ``loss_parallel``, ``vocab_parallel.loss_context``)."""
    tp = tp_mesh.size()
    sp = sequence_parallel_copies(model, plan)
    blocks = {}
    for block, branches in sharded_branches(plan).items():
        check_degree(block, branches, tp)
        copies = block_modules(model, {"blocks": [{"block": block}]})
        if not copies:
            raise TensorOptError(f"the plan shards block {block!r} over {tp} devices, but no module of this model "
                                 "matches that name: the plan was made for another model")
        for name in copies:
            check_linears(model.get_submodule(name), name, branches, tp)
        blocks[block] = (copies, branches)
    for block in plan["blocks"]:      # sequence-parallel copies of a block none of whose branches is sharded
        copies = block_modules(model, {"blocks": [block]})
        if block["block"] not in blocks and any(c in sp for c in copies):
            blocks[block["block"]] = (copies, [])
    if example_inputs is not None:
        from .tp_guard import check_sharded_blocks
        check_sharded_blocks(model, example_inputs, {b: (c[0], br) for b, (c, br) in blocks.items()}, tp_mesh,
                             device, {b: layout_of(plan, b) for b, (c, _) in blocks.items() if c[0] in sp})
    for block, (copies, branches) in blocks.items():
        relay: dict = {}
        for name in copies:
            shard_copy(model.get_submodule(name), branches, tp_mesh, layout_of(plan, block) if name in sp else None,
                       name, sp.get(name, (False, False, False)), relay)
    return apply_vocab_parallel(model, plan, tp_mesh)


def shard_copy(copy: nn.Module, branches: list[dict], tp_mesh, sp_layout: list[dict] | None = None, name: str = "",
               handoff: tuple[bool, bool, bool] = (False, False, False), relay: dict | None = None,
               stream_argument: int | None = None) -> None:
    """Shard one copy of a block: its branches' column and row linears, as the layout describes them; with
    ``sp_layout`` (every branch of the block) the copy runs sequence-parallel too."""
    from torch.distributed.tensor.parallel import parallelize_module
    if branches:
        parallelize_module(copy, tp_mesh, styles(copy, branches, tp_mesh.size(), sp_layout is not None))
    if sp_layout is not None:
        apply_sequence_parallel(copy, name, sp_layout, branches, tp_mesh, handoff, relay, stream_argument)


def sharded_branches(plan: dict) -> dict[str, list[dict]]:
    """{block pattern: its branches that the plan shards}, from plan.json's ``tp_layout``."""
    layout = plan.get(TP_LAYOUT_KEY)
    if layout is None:
        raise TensorOptError(f"plan {plan['summary']} asks for tensor parallelism but its plan.json has no "
                             f"'{TP_LAYOUT_KEY}' (which linears to shard): start the workers with `tensoropt launch`, "
                             "which writes it")
    chosen = set(plan["tp_branches"])
    out = {}
    for block in plan["blocks"]:
        branches = [b for b in layout.get(block["block"], []) if b["branch"] in chosen]
        if branches:
            out[block["block"]] = branches
    if chosen and not out:
        raise TensorOptError(f"plan {plan['summary']} shards branches {sorted(chosen)}, but its '{TP_LAYOUT_KEY}' has "
                             "none of them: the plan was made for another model")
    return out


def check_degree(block: str, branches: list[dict], tp: int) -> None:
    """Refuse a degree that would split a head or a feature group (a hand-edited plan; the planner
    never proposes one): the ranks' shares would not be whole heads and results would be wrong."""
    for branch in branches:
        if branch["max_tp"] % tp:
            raise TensorOptError(f"tensor parallelism over {tp} devices splits the heads or features of branch "
                                 f"{branch['branch']!r} in block {block!r}: tp must divide {branch['max_tp']}")


def styles(copy: nn.Module, branches: list[dict], tp: int, sequence_parallel: bool = False) -> dict:
    """``parallelize_module``'s plan for one block copy: module name -> its column or row style (under sequence
    parallelism the row linears reduce-scatter along the sequence)."""
    from .tp_styles import column_style, row_style
    out = {}
    for branch in branches:
        segments = branch.get("segments", {})
        out |= {name: column_style(copy.get_submodule(name), segments.get(name), tp) for name in branch["column"]}
        out |= {name: row_style(copy.get_submodule(name), sequence_parallel) for name in branch["row"]}
    return out


def check_linears(copy: nn.Module, copy_name: str, branches: list[dict], tp: int) -> None:
    """Every module to shard must be an ``nn.Linear`` or a ``Conv1D`` whose sharded features (each segment's, for a
    fused projection) ``tp`` divides: ``parallelize_module`` would otherwise fail deep inside DTensor, or shard
    unevenly."""
    from ..space.tp_check import linear_kind
    for branch in branches:
        segments = branch.get("segments", {})
        for name, role in [(n, "column") for n in branch["column"]] + [(n, "row") for n in branch["row"]]:
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
            parts = segments.get(name, [features]) if role == "column" else [features]
            if sum(parts) != features or any(p % tp for p in parts):
                raise TensorOptError(f"{copy_name}.{name} has {features} features ({'+'.join(map(str, parts))}), "
                                     f"which do not split over {tp} tensor-parallel devices")


__all__ = ["apply_tensor_parallel", "sharded_branches"]
