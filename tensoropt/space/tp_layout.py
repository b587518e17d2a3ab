"""The tensor-parallel layout the runtime applies, derived from the same block analysis the planner costs.

The planner decides *which* branches are sharded (``Plan.tp_branches``, by branch name); this module
says *which modules* those branches are, so the workers shard exactly the linears the cost model
assumed, whatever the model calls them (``attn.qkv``, ``self_attn.q_proj``, ...). It is pure: a
captured graph in, module names out, written by the launcher into plan.json as ``tp_layout``::

    {"layers.*": [{"branch": "attn", "column": ["attn.qkv"], "row": ["attn.proj"], "max_tp": 4},
                  {"branch": "mlp", "column": ["mlp.up"], "row": ["mlp.down"], "max_tp": 256}]}

Names are relative to each copy of the block (``layers.0``, ``layers.1``, ...), so the layout does not
grow with depth; they name the module that owns the linear's weight, which is what
``parallelize_module`` shards. ``max_tp`` is what every tensor-parallel degree must divide (heads,
key/value heads, features), so the runtime can refuse a hand-edited plan that would split a head.
"""

from __future__ import annotations

from ..graph.fold import FoldedGraph, fold
from ..graph.ir import Op, OpGraph
from .block import Branch, analyse_block, owner_module
from .tp_meta import tp_checks

TP_LAYOUT_KEY = "tp_layout"


def tp_layout(graph: OpGraph, folded: FoldedGraph | None = None) -> dict[str, list[dict]]:
    """Every tensor-parallel branch of every unique block of ``graph`` (see the module doc); blocks
    without a branch are left out. Pass ``folded`` when the caller has already folded the graph."""
    folded = folded or fold(graph)
    seq_len = int(graph.meta("seq_len") or 0) or None
    out: dict[str, list[dict]] = {}
    for block in folded.blocks:
        scope = block.occurrences[0].scope          # the template carries the first copy's names
        space = analyse_block(block.ops, seq_len, checks=tp_checks(graph, block.name))
        branches = [_branch(b, block.ops, scope) for b in space.branches]
        if branches:
            out[block.name] = branches
    return out


def not_offered(graph: OpGraph, folded: FoldedGraph | None = None) -> list[str]:
    """One line per layout the space leaves out of every plan, with its reason: each branch tensor parallelism
    keeps replicated (``space.block``, ``space.tp_check``, the runtime's run at capture) and each block that is
    never run sequence-parallel (``space.sp_check``, the same run); for ``launch`` and ``inspect`` to state."""
    folded = folded or fold(graph)
    seq_len = int(graph.meta("seq_len") or 0) or None
    out = []
    for block in folded.blocks:
        space = analyse_block(block.ops, seq_len, checks=tp_checks(graph, block.name))
        out += [f"{block.name}: branch {name!r} not sharded: {why}" for name, why in space.refused]
        if space.branches and space.sequence_refused:
            out.append(f"{block.name}: no sequence parallelism: {space.sequence_refused}")
    return out


def _branch(branch: Branch, ops: tuple[Op, ...], scope: str) -> dict:
    out = {"branch": branch.name, "column": [owner_module(ops[i], scope) for i in branch.column],
           "row": [owner_module(ops[i], scope) for i in branch.row], "max_tp": branch.max_tp}
    segments = {owner_module(ops[i], scope): list(layout.segments)
                for i, layout in zip(branch.column, branch.layouts) if layout.kind == "segments"}
    return out | ({"segments": segments} if segments else {})


__all__ = ["TP_LAYOUT_KEY", "not_offered", "tp_layout"]
