"""The plan's blocks in a model: which modules are the copies of each block the plan names (plan.json's
``blocks[].block`` patterns, ``layers.*``, or slices of a pattern's matches, ``layers.*[0:3]``), and replacing one by
a wrapper. Every part of the runtime that acts per block copy (tensor and sequence parallelism, recomputation, FSDP2
units, pipeline cuts) finds the copies here, so they all agree on which modules they are."""

from __future__ import annotations

from torch import nn

from ..errors import TensorOptError
from ..graph.block_names import picked
from ..space.plan import Plan, acts_per_copy


def copies_of(model: nn.Module, block: str) -> list[str]:
    """Module names of every copy of one block, in model order: ``layers.*`` -> layers.0, layers.1, ...; a block
    sharing its pattern with another holds a slice of them, ``layers.*[3:61]`` -> layers.3 ... layers.60
    (``graph.block_names``)."""
    try:
        return picked((n for n, _ in model.named_modules()), block)
    except ValueError as exc:
        raise TensorOptError(str(exc)) from None


def check_copies(model: nn.Module, plan: Plan, engine: str) -> None:
    """A one-line ``TensorOptError`` where the modules a plan block's name finds are not its copies (as many as the
    plan runs, ``copies x pp``) and the engine acts on them one by one: recomputation, sequence or tensor
    parallelism, pipeline cuts, compilation, the torch engine's FSDP2 units. The plan was priced for those copies;
    run on other modules, or on none (a copy spanning two modules, ``layers.{0,1}``; copies of no common scope,
    ``block<i>``), it would use another memory and time than priced, silently. A block whose name finds no module
    and that the engine runs as a whole (DDP or DeepSpeed, no copy-wise strategy) runs as priced; the planner offers
    no other plan for it (``planning``)."""
    for bp in plan.blocks:
        found = copies_of(model, bp.block)
        if len(found) == bp.copies * plan.pp:
            continue
        if found or acts_per_copy(plan, bp, engine):
            raise TensorOptError(
                f"block {bp.block!r}: the plan runs {bp.copies * plan.pp} copies of it, and its name finds "
                f"{len(found)} modules of this model{' (' + ', '.join(found[:4]) + ')' if found else ''}: the "
                f"{engine} engine acts on a block's copies by name; run this model with a plan that recomputes "
                "none of its copies, without tensor, pipeline or sequence parallelism, compile or torch FSDP2")


def block_modules(model: nn.Module, plan: Plan) -> list[str]:
    """Module names of every copy of the plan's blocks, block by block, each in model order."""
    return [name for bp in plan.blocks for name in copies_of(model, bp.block)]


def largest_block_bytes(model: nn.Module, plan: Plan) -> int:
    """Bytes of the parameters and buffers of the plan's largest block copy (on meta too: no memory read)."""
    sizes = [sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))
             for m in map(model.get_submodule, block_modules(model, plan))]
    return max(sizes, default=0)


def replace_module(model: nn.Module, name: str, wrap) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, wrap(getattr(parent, child)))


__all__ = ["block_modules", "check_copies", "copies_of", "largest_block_bytes", "replace_module"]
