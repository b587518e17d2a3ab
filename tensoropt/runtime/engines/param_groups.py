"""The script's optimizer, with parameter groups that never mix DTensors and plain tensors.

Tensor parallelism turns only the sharded linears' parameters into DTensors; norms and embeddings stay
plain tensors. On CUDA, ``torch.optim`` optimizers default to their foreach kernels, and a foreach op over a
list mixing both kinds fails (``aten._foreach_mul_.Scalar got mixed torch.Tensor and DTensor``) at the
first step; CPUs default to the per-tensor loop, which hides it (``foreach=True`` shows it on CPU). So every
engine builds the script's optimizer through ``build_optimizer``: each group the script made is split in
place into one group per kind, each keeping the script group's hyper-parameters (weight decay, lr...).

The optimizer's own ``state_dict()`` stays in the script's group layout (its groups, its order, whatever the
plan split), and ``load_state_dict`` takes that layout back (or the split one, which
``torch.distributed.checkpoint.state_dict.set_state_dict`` builds from ``param_groups``): a checkpoint written
under tensor parallelism resumes under a plan without it and the reverse. What sees the split: code that
indexes ``optimizer.param_groups`` by position (a scheduler with one factor per group); setting a value on
every group, as warm-up loops do, is unaffected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..parallel.partial_grads import reduce_before_step

OptimizerFn = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
NAMES = "param_names"          # torch keeps a group's parameter names here when it was built from named_parameters


@dataclass(frozen=True)
class Split:
    """One group the optimizer holds: script group ``group``'s parameters at ``positions`` (in its order)."""

    group: int
    positions: tuple[int, ...]


def is_dtensor(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(param, DTensor)


def kind_splits(groups: list[dict]) -> list[Split]:
    """Each group's parameters by kind (DTensor or plain tensor), the kinds in order of first appearance."""
    out = []
    for index, group in enumerate(groups):
        by_kind: dict[bool, list[int]] = {}
        for position, param in enumerate(group["params"]):
            by_kind.setdefault(is_dtensor(param), []).append(position)
        out += [Split(index, tuple(positions)) for positions in by_kind.values()] or [Split(index, ())]
    return out


def _subgroup(group: dict, positions: tuple[int, ...]) -> dict:
    """``group`` (live or as a state dict holds it) restricted to the parameters at ``positions``."""
    out = dict(group)
    for key in ("params", NAMES):
        if key in group:
            out[key] = [group[key][i] for i in positions]
    return out


def build_optimizer(optimizer_fn: OptimizerFn | None, params: Iterable[torch.nn.Parameter]):
    """``optimizer_fn(params)``, its groups split so none mixes DTensors and plain tensors (see module doc), and the
    gradients that are partial sums over a tensor-parallel group (sequence parallelism's norm weights) summed once
    before each step, in one bucket (``partial_grads``); None without an ``optimizer_fn``."""
    if optimizer_fn is None:
        return None
    optimizer = optimizer_fn(params)
    if isinstance(optimizer, torch.optim.Optimizer):
        split_by_kind(optimizer)
        reduce_before_step(optimizer)
    return optimizer


def split_by_kind(optimizer: torch.optim.Optimizer) -> list[Split]:
    """Split ``optimizer``'s groups in place by parameter kind, and keep its state dicts in the layout it was
    built with; returns the splits (one per original group when nothing was mixed, and nothing changes)."""
    splits = kind_splits(optimizer.param_groups)
    if len(splits) == len(optimizer.param_groups):
        return splits
    if optimizer.state:
        raise ValueError("split_by_kind splits an optimizer before its first step")
    layout = Layout(tuple(splits), len(optimizer.param_groups))
    optimizer.param_groups[:] = [_subgroup(optimizer.param_groups[s.group], s.positions) for s in splits]
    optimizer.register_state_dict_post_hook(layout.to_script)
    optimizer.register_load_state_dict_pre_hook(layout.to_split)
    return splits


@dataclass(frozen=True)
class Layout:
    """How an optimizer's groups (``splits``, in its order) come from the ``script_groups`` the script made."""

    splits: tuple[Split, ...]
    script_groups: int

    def to_script(self, _optimizer, state_dict: dict) -> dict:
        """``Optimizer.state_dict`` post-hook: the groups as the script made them."""
        return {**state_dict, "param_groups": self.merged(state_dict["param_groups"])}

    def to_split(self, _optimizer, state_dict: dict) -> dict:
        """``Optimizer.load_state_dict`` pre-hook: the script's groups (or the split ones) as the optimizer holds
        them."""
        groups = state_dict["param_groups"]
        if len(groups) == len(self.splits):
            # as the optimizer holds them: set_state_dict's way, which gives a script group's settings to only
            # one of its parts; merged first, so that every part gets them
            groups = self.merged(groups)
        if len(groups) != self.script_groups:
            raise ValueError(f"the optimizer state has {len(groups)} parameter groups, the script made "
                             f"{self.script_groups}")
        return {**state_dict, "param_groups": [_subgroup(groups[s.group], s.positions) for s in self.splits]}

    def merged(self, groups: list[dict]) -> list[dict]:
        """State-dict groups in split layout (``groups[i]`` holds ``splits[i]``) merged back into the script's
        groups, each parameter at its position there. Parameter ids stay those of the split layout, which is
        what both ``Optimizer.load_state_dict`` (it pairs ids with parameters by position) and
        ``torch.distributed.checkpoint`` (it names ids by the optimizer's ``param_groups``) expect."""
        merged: list[dict] = [{} for _ in range(self.script_groups)]
        for group, split in zip(groups, self.splits, strict=True):
            target = merged[split.group]
            for key, value in group.items():
                if key not in ("params", NAMES):
                    target.setdefault(key, value)
            for key in ("params", NAMES):
                if key in group:
                    slots = target.setdefault(key, [None] * _size(self.splits, split.group))
                    for position, value in zip(split.positions, group[key], strict=True):
                        slots[position] = value
        return merged


def _size(splits: tuple[Split, ...], group: int) -> int:
    return sum(len(s.positions) for s in splits if s.group == group)


__all__ = ["Layout", "Split", "build_optimizer", "kind_splits", "split_by_kind"]
