"""Run each tensor-parallel branch on one rank's share of features, on fake tensors, while the model is captured.

The block analysis (``space.block``, ``space.fused``) reads *which* features each op takes from a column linear.
It cannot read *how the model's code computes* its split points: ``qkv.chunk(3, -1)`` and
``qkv.split(qkv.shape[-1] // 3, -1)`` take their sizes from the tensor and work on a rank's share, while
nanoGPT's ``qkv.split(self.n_embd, -1)`` or Phi-3's ``qkv[..., :num_heads * head_dim]`` hard-code the full
width: on a share they crash (``not enough values to unpack``) or, worse, slice the wrong features. So while
the model is still at hand, each branch of each unique block is run, in its first copy, the way one of
``tp`` ranks runs it: every column linear returns ``1/tp`` of its output features, every row linear must
receive ``1/tp`` of its input features (then runs on an input of full width, so the rest of the block runs
unchanged). Shapes only: fake tensors, nothing allocated, no values. A branch whose code fails, or hands a
row linear the wrong width, at a degree, is never planned at that degree (nor at its multiples); the result
is kept in the graph's metadata (``TP_CHECKS_META``) and read by the block analysis, so the search, the cost
model and the launcher's layout all see the same branches.

Values are checked by the runtime before training (``runtime.parallel.tensor_parallel``): the sharded block's output
against the unsharded block's on a small real input.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..graph import block_verdicts
from ..graph.fold import fold
from ..graph.grouped_mm_meta import install_grouped_mm_meta
from ..graph.ir import Op, OpGraph
from .block import analyse_block, in_features, out_features, owner_module
from .tp_meta import TP_CHECKS_META, tp_checks, with_tp_checks

MAX_CHECKED_TP = 64              # degrees above this are never planned (no node holds more devices)


class _Reached(Exception):
    """Stops the model's forward once every block's first copy has been entered."""


class _WrongWidth(Exception):
    pass


def check_tensor_parallel(model: nn.Module, example_inputs: tuple | Mapping, graph: OpGraph,
                          cache_dir: Path | None = None, sources: Iterable[str] = ()) -> dict:
    """{block: {branch: {"max_tp": m} | {"refused": why}}} for every branch of every unique block of ``graph``
    (``model``'s captured graph, run on ``example_inputs``); {} when no block has a branch. With ``cache_dir``, a
    block whose verdicts are stored there (``graph.block_verdicts``, keyed by its ops, branches, tensors and the
    code of ``sources`` and of its classes) is not run again."""
    install_grouped_mm_meta()        # a float32 MoE layer's grouped products run on these fakes (graph.grouped_mm_meta)
    seq_len = int(graph.meta("seq_len") or 0) or None
    targets = {}
    for block in fold(graph).blocks:
        branches = analyse_block(block.ops, seq_len).branches
        if branches:
            targets[block.name] = (block.occurrences[0].scope, block.ops, branches)
    if not targets:
        return {}
    modules = dict(model.named_modules())
    out: dict[str, dict] = {}
    order = list(targets)
    missed = {}
    if cache_dir is not None:
        keys = {name: block_verdicts.block_key("tp_check", modules[scope], ops, tuple(sources), branches=[
            repr(b) for b in branches]) for name, (scope, ops, branches) in targets.items() if scope in modules}
        missed = block_verdicts.reuse(cache_dir, keys, targets, out)
    if targets:
        _check_blocks(model, example_inputs, targets, modules, out)
    block_verdicts.keep(cache_dir, missed, out)
    return {name: out[name] for name in order}


def _check_blocks(model: nn.Module, example_inputs, targets: dict, modules: dict, out: dict) -> None:
    """Run each branch of ``targets``' blocks as one rank's share, its verdicts into ``out``."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    scopes = {scope for scope, _, _ in targets.values() if scope in modules}
    inputs = first_copy_inputs(model, example_inputs, scopes, fake_mode)
    for name, (scope, ops, branches) in targets.items():
        out[name] = {}
        for branch in branches:
            if scope not in inputs:
                out[name][branch.name] = {"refused": f"the block's copies ({scope or 'the model itself'}) are not "
                                                     "modules the runtime can shard"}
                continue
            result = _check_branch(modules[scope], inputs[scope], ops, scope, branch, fake_mode)
            out[name][branch.name] = _stricter(out[name].get(branch.name), result)


def _stricter(a: dict | None, b: dict) -> dict:
    """Two branches of one name (same-named modules, sharded together): what both allow."""
    if a is None or "refused" in a:
        return a or b
    return b if "refused" in b else {"max_tp": math.gcd(a["max_tp"], b["max_tp"])}


def linear_kind(module: nn.Module) -> str | None:
    """"linear" (``nn.Linear``: weight (out, in), x @ W^T), "conv1d" (``transformers``' ``Conv1D``: weight
    (in, out), x @ W), or None for a module the runtime cannot shard."""
    if isinstance(module, nn.Linear):
        return "linear"
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2 \
            and getattr(module, "nf", None) == weight.shape[1]:
        return "conv1d"
    return None


def first_copy_inputs(model: nn.Module, example_inputs, scopes: set[str], fake_mode,
                      device: torch.device | None = None) -> dict[str, tuple]:
    """(args, kwargs) each module in ``scopes`` is first called with, from one fake forward of the model,
    stopped once all were reached (a forward up to the first block costs next to nothing). With ``device``,
    every parameter, buffer and input is a fake tensor on ``device`` for that forward: a model built on meta
    whose buffers were built for real (``tensoropt.meta_init``) mixes devices otherwise."""
    from ..graph.capture import gpu_kernels
    seen: dict[str, tuple] = {}

    def record(scope, _module, args, kwargs):
        seen.setdefault(scope, (args, _without_caches(kwargs)))
        if len(seen) == len(scopes):
            raise _Reached
    handles = [model.get_submodule(s).register_forward_pre_hook(
        lambda m, a, k, s=s: record(s, m, a, k), with_kwargs=True) for s in scopes]
    try:
        with fake_mode, gpu_kernels():
            if isinstance(example_inputs, Mapping):
                args, kwargs = (), {k: _fake(fake_mode, v, device) for k, v in example_inputs.items()}
            else:
                args, kwargs = tuple(_fake(fake_mode, v, device) for v in example_inputs), {}
            if device is None:
                model(*args, **kwargs)
            else:
                named = [*model.named_parameters(), *model.named_buffers()]   # tied: once; functional_call ties
                states = {name: _fake(fake_mode, t, device) for name, t in named}
                torch.func.functional_call(model, states, args, kwargs)
    except _Reached:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _fake(fake_mode, value, device: torch.device | None = None):
    if not isinstance(value, torch.Tensor):
        return value
    if device is None:
        return fake_mode.from_tensor(value)
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)   # under fake_mode


def _without_caches(kwargs: dict) -> dict:
    """Key/value caches (Hugging Face ``Cache`` objects) grow with every call: the checks run a block many
    times, so they run it without one, as training does."""
    return {k: None if type(v).__name__.endswith("Cache") else v for k, v in kwargs.items()}


def _check_branch(copy: nn.Module, inputs: tuple, ops: tuple[Op, ...], scope: str, branch, fake_mode) -> dict:
    """The largest degree m dividing the branch's ``max_tp`` whose divisors all run as one rank's share."""
    failed: dict[int, str] = {}
    for tp in checked_degrees(branch.max_tp):
        if any(tp % bad == 0 for bad in failed):
            continue
        problem = _run_share(copy, inputs, ops, scope, branch, tp, fake_mode)
        if problem:
            failed[tp] = problem
    good = [m for m in checked_degrees(branch.max_tp) if not any(m % bad == 0 for bad in failed)]
    if not good:
        tp, why = min(failed.items())
        return {"refused": f"on one of {tp} tensor-parallel ranks {why}"}
    return {"max_tp": max(good)}


def checked_degrees(max_tp: int) -> list[int]:
    """The tensor-parallel degrees above 1 dividing ``max_tp``, up to ``MAX_CHECKED_TP``, ascending: the ones the
    capture's checks run."""
    return [d for d in range(2, min(max_tp, MAX_CHECKED_TP) + 1) if max_tp % d == 0]


def _run_share(copy: nn.Module, inputs: tuple, ops: tuple[Op, ...], scope: str, branch, tp: int,
               fake_mode) -> str | None:
    """Why ``copy`` does not run branch ``branch`` as one of ``tp`` ranks, or None when it does."""
    columns = {owner_module(ops[i], scope): out_features(ops[i]) for i in branch.column}
    rows = {owner_module(ops[i], scope): in_features(ops[i]) for i in branch.row}
    called: set[str] = set()

    def share_of_output(name, features):
        def hook(_module, _args, output):
            called.add(name)
            return output.narrow(-1, 0, features // tp)
        return hook

    def whole_input(name, features):
        def hook(_module, args):
            called.add(name)
            x = args[0]
            if x.shape[-1] != features // tp:
                raise _WrongWidth(f"{scope}.{name} receives {x.shape[-1]} input features where one rank holds "
                                  f"{features // tp} of {features}")
            return (x.repeat(*[1] * (x.dim() - 1), tp), *args[1:])
        return hook
    try:
        kinds = {n: linear_kind(copy.get_submodule(n)) for n in (*columns, *rows)}
    except AttributeError as exc:
        return f"a linear is not a submodule of its block ({exc})"
    if unknown := [f"{n} is a {type(copy.get_submodule(n)).__name__}" for n, kind in kinds.items() if kind is None]:
        return f"{'; '.join(unknown)}: the runtime shards nn.Linear and transformers' Conv1D modules"
    try:
        handles = [copy.get_submodule(n).register_forward_hook(share_of_output(n, f)) for n, f in columns.items()]
        handles += [copy.get_submodule(n).register_forward_pre_hook(whole_input(n, f)) for n, f in rows.items()]
    except AttributeError as exc:
        return f"a linear is not a submodule of its block ({exc})"
    names = {id(m): f"{scope}.{n}" if n else scope for n, m in copy.named_modules()}
    stack: list[str] = []
    handles.append(nn.modules.module.register_module_forward_pre_hook(
        lambda m, _a: stack.append(names.get(id(m), type(m).__name__))))


    def leave(_module, _args, _output) -> None:
        stack.pop()
    handles.append(nn.modules.module.register_module_forward_hook(leave))
    args, kwargs = inputs
    try:
        with fake_mode:
            copy(*args, **kwargs)
    except _WrongWidth as exc:
        return str(exc)
    except Exception as exc:  # the model's own code failing on a share is the finding, not an error here
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"the code of {stack[-1] if stack else scope} fails: {type(exc).__name__}: {text}"
    finally:
        for handle in handles:
            handle.remove()
    if missing := sorted((set(columns) | set(rows)) - called):
        return f"{', '.join(missing)} is not called as a module (the runtime shards modules)"
    return None


__all__ = ["MAX_CHECKED_TP", "TP_CHECKS_META", "check_tensor_parallel", "checked_degrees", "linear_kind", "tp_checks",
           "with_tp_checks"]
