"""The plan's blocks in a model: which modules are the copies of each block the plan names (plan.json's
``blocks[].block`` patterns, ``layers.*``), and replacing one by a wrapper. Every part of the runtime that acts
per block copy (tensor and sequence parallelism, recomputation, FSDP2 units, pipeline cuts) finds the copies
here, so they all agree on which modules they are."""

from __future__ import annotations

import fnmatch

from torch import nn

from ..space.plan import Plan


def copies_of(model: nn.Module, pattern: str) -> list[str]:
    """Module names of every copy of one block (``layers.*`` -> layers.0, layers.1, ...), in model order."""
    depth = pattern.count(".")
    return [n for n, _ in model.named_modules() if fnmatch.fnmatchcase(n, pattern) and n.count(".") == depth]


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


__all__ = ["block_modules", "copies_of", "largest_block_bytes", "replace_module"]
