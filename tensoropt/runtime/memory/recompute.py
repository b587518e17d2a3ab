"""Activation recomputation per block copy, as the plan's strategies say: full (torch's
``checkpoint_wrapper``: the copy keeps only its input and runs its forward again in the backward) or
selective (``runtime.memory.selective``: every saved tensor but the attention core's, Korthikanti et al. 2022)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from ...space.plan import Plan
from ..blocks import copies_of, replace_module
from .selective import selective_wrapper


def recomputed_modules(model: nn.Module, plan: Plan, kind: str = "full") -> list[str]:
    """The block copies the plan recomputes as ``kind`` says (full or selective): on each pipeline stage,
    the stage's first copies of each block, as many as its strategies say (strategies carry copy counts per
    stage). With virtual stages a device's copies are its stages' shares (stages r, r + pp, ...), in order."""
    out = []
    stages = plan.pp * plan.virtual_stages
    for bp in plan.blocks:
        copies = copies_of(model, bp.block)
        per_stage = [s.recompute for s, n in bp.strategies for _ in range(n)]
        size = max(len(copies) // stages, 1)        # copies per (virtual) stage
        for i, name in enumerate(copies):
            stage, offset = divmod(i, size)
            position = (stage // plan.pp) * size + offset   # among its device's copies
            if position < len(per_stage) and per_stage[position] == kind:
                out.append(name)
    return out


def recompute_wrappers(model: nn.Module, plan: Plan) -> dict[str, object]:
    """{block copy: the wrapper that recomputes it}: ``checkpoint_wrapper`` for full recomputation, the
    selective one (``runtime.memory.selective``: the attention core only) for selective."""
    return {**{name: checkpoint_wrapper for name in recomputed_modules(model, plan, "full")},
            **{name: selective_wrapper for name in recomputed_modules(model, plan, "selective")}}


def apply_recompute(model: nn.Module, plan: Plan) -> None:
    for name, wrap in recompute_wrappers(model, plan).items():
        replace_module(model, name, wrap)


__all__ = ["apply_recompute", "recompute_wrappers", "recomputed_modules"]
